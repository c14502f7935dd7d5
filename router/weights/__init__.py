"""Weight updates orchestrated by the router (issue 10, DESIGN rules 4 and 6, README "Version contract").

``report``: what an answer says about its versions; ``steps``: one replica's update, step by
step; ``updater``: one update at a time over the fleet (folder reload and two-phase push),
owned by the app, so a client going away never leaves a replica paused or out of rotation.
Import the modules themselves (this package imports nothing, so ``router.lifecycle`` can use
``report`` without a cycle).
"""
