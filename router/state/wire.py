"""What routers write to Redis: key names, value encodings and the atomic scripts (issue 13).

Keys, all under ``prefix`` (``router.redis_prefix``)::

    pin:<kind>:<key>     "<replica>|<start version or empty>"   first writer wins (CLAIM), EX pin TTL
    versions             hash: epoch, snapshot (JSON, cache_policy.sharing), by (router id)
    versions:epoch       the same epoch as a plain string (read with the pins, one round trip)
    replicas             hash: replica id -> JSON entry (endpoint, state, seq, by)
    replicas:seq         counter stamping registry entries
    routers              zset: router id -> last heartbeat (unix seconds)
    router:<id>          JSON: that router's view (versions, replicas, in flight), EX router TTL
    load:<id>            JSON: that router's in-flight share per replica, EX router TTL
    marked:<id>          the newest versions epoch that router applied, its kept streams' spans marked, EX router TTL
    lock:update          owner of the weight-update lock, PX its TTL
    instance             random token: a different or missing one means Redis restarted empty
    events               pub/sub channel: "pin\\t<key>\\t<value or - when ended>", "versions\\t<epoch>", "replicas\\t<seq>"
"""

from __future__ import annotations

from dataclasses import dataclass

CLAIM = """
-- KEYS: pin keys; ARGV[1] ttl, ARGV[2] channel, then per key: expected replica ('' = none), replica, start version
local ttl = tonumber(ARGV[1])
local out = {}
for i, key in ipairs(KEYS) do
  local expected, rid, sv = ARGV[3 * i], ARGV[3 * i + 1], ARGV[3 * i + 2]
  local cur = redis.call('GET', key)
  local value = nil
  if not cur then
    value = rid .. '|' .. sv
  else
    local cur_rid, cur_sv = string.match(cur, '^(.*)|(.*)$')
    if cur_rid == expected and cur_rid ~= rid then value = rid .. '|' .. cur_sv end
  end
  if value then
    redis.call('SET', key, value, 'EX', ttl)
    redis.call('PUBLISH', ARGV[2], 'pin\\t' .. key .. '\\t' .. value)
    out[i] = value
  else
    redis.call('EXPIRE', key, ttl)
    out[i] = cur
  end
end
return out
"""
"""First writer wins, atomically: a pin is written when absent, or moved when it still names
the replica the writer read (a deliberate move: unhealthy or over its load); otherwise the
current value wins and is returned. The start version of a moved pin is kept."""

PUBLISH_VERSIONS = """
-- KEYS: versions hash, epoch key; ARGV: snapshot JSON, router id, channel, restore epoch ('' = new),
-- floor (the publisher's own epoch), retry ('1': not over another router's newer snapshot),
-- recomputed (JSON: replicas whose version just moved -> whether their kept streams recomputed)
local cur = tonumber(redis.call('GET', KEYS[2]) or '-1')
local epoch
if ARGV[4] == '' then
  local floor = tonumber(ARGV[5]) or -1
  if ARGV[6] == '1' and cur > floor and redis.call('HGET', KEYS[1], 'by') ~= ARGV[2] then return {cur, 0} end
  epoch = math.max(cur, floor) + 1
else
  epoch = tonumber(ARGV[4])
  if epoch <= cur then return {cur, 0} end
end
redis.call('SET', KEYS[2], epoch)
redis.call('HSET', KEYS[1], 'epoch', epoch, 'snapshot', ARGV[1], 'by', ARGV[2], 'recomputed', ARGV[7] or '')
redis.call('PUBLISH', ARGV[3], 'versions\\t' .. epoch)
return {epoch, 1}
"""
"""Returns ``{epoch in Redis, 1 if written else 0}``. A new snapshot gets an epoch past both
Redis's and the publisher's own (``floor``): after Redis lost its data (restarted empty,
flushed) the epoch counter starts again, and routers that applied a higher epoch would ignore
every snapshot below it. A ``retry`` (a publication whose answer never came, sent again) is
written only while no other router published past ``floor``. A restored one (after Redis
restarted empty) is written only when its epoch is newer than what Redis holds."""

PIN_ENDED = "-"
"""The value an ``events`` pin message carries when its session ended (no pin is ``"|"``-less)."""

END_PIN = """
-- KEYS: pin key; ARGV: channel, the ended marker, deadline (Redis's clock, microseconds)
local t = redis.call('TIME')
if tonumber(t[1]) * 1000000 + tonumber(t[2]) > tonumber(ARGV[3]) then return -1 end
local had = redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[1], 'pin\\t' .. KEYS[1] .. '\\t' .. ARGV[2])
return had
"""
"""A session's client ended it (``DELETE /v1/sessions/{id}`` or its ``X-Session-End`` turn): its
pin goes (a new session under the id starts fresh, not on the old replica and version) and every
router ends its own record. Returns 1 when Redis held the pin, -1 (nothing done) past its deadline:
an end Redis runs late (it was stalled; the caller gave up) could not tell the ended session from a
new one another router started under the id meanwhile."""

RELEASE_LOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

REFRESH_LOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

PUT_REPLICA = """
-- KEYS: replicas hash, seq key; ARGV: replica id, entry JSON without seq (ends with '}'), channel,
-- the writer's router id while it joins (else ''), the routers' view key prefix (``router:``: a
-- view lives while its router beats). A joining router's write is refused (0) when the entry
-- there, written by another router still alive, puts the replica at another base_url and neither
-- is a removal: two routers giving one id to two servers (started at once with different
-- replicas.urls); the first writer keeps the id, the other reads its entry next (a conflict, or
-- the same server spelt otherwise).
local old = ARGV[4] ~= '' and redis.call('HGET', KEYS[1], ARGV[1])
if old then
  local there, here = cjson.decode(old), cjson.decode(ARGV[2])
  if there.by ~= ARGV[4] and there.state ~= 'removed' and here.state ~= 'removed'
      and there.base_url ~= here.base_url and redis.call('EXISTS', ARGV[5] .. tostring(there.by)) == 1 then
    return 0
  end
end
local seq = redis.call('INCR', KEYS[2])
local entry = string.sub(ARGV[2], 1, -2) .. ', "seq": ' .. seq .. '}'
redis.call('HSET', KEYS[1], ARGV[1], entry)
redis.call('PUBLISH', ARGV[3], 'replicas\\t' .. seq)
return seq
"""

DROP_REPLICA = """
-- KEYS: replicas hash; ARGV: replica id, the entry's text as read. Deletes it only if unchanged.
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""

CLAIM_REPLICA_INDEX = """
-- KEYS: replicas hash, next-index key; ARGV: the caller's own next index.
-- An index at least ARGV[1], above every 'replica-<n>' in the registry and every index claimed
-- before (by any router): two routers adding a replica at once never get the same id.
local n = math.max(tonumber(ARGV[1]), tonumber(redis.call('GET', KEYS[2]) or '0'))
for _, rid in ipairs(redis.call('HKEYS', KEYS[1])) do
  local i = string.match(rid, '^replica%-(%d+)$')
  if i and tonumber(i) >= n then n = tonumber(i) + 1 end
end
redis.call('SET', KEYS[2], n + 1)
return n
"""

CLAIM_ADDRESSES = """
-- KEYS: one per socket address of a server being added; ARGV: owner (one per claim), ttl ms.
-- All or none: 1 when none was held (now all are, for ttl ms), else 0.
for _, k in ipairs(KEYS) do if redis.call('EXISTS', k) == 1 then return 0 end end
for _, k in ipairs(KEYS) do redis.call('SET', k, ARGV[1], 'PX', ARGV[2]) end
return 1
"""

RELEASE_ADDRESSES = """
-- KEYS: hold keys of CLAIM_ADDRESSES; ARGV: owner, ms (0: let go now, else expire in ms).
-- Only that claim's holds: one another claim took since is left alone.
for _, k in ipairs(KEYS) do
  if redis.call('GET', k) == ARGV[1] then
    if tonumber(ARGV[2]) > 0 then redis.call('PEXPIRE', k, ARGV[2]) else redis.call('DEL', k) end
  end
end
return 1
"""


@dataclass(frozen=True)
class Keys:
    """Key names under one ``prefix``."""

    prefix: str

    def pin(self, kind: str, key: str) -> str:
        """``pin:<kind>:<key>``."""
        return f"{self.prefix}pin:{kind}:{key}"

    def __getattr__(self, name: str) -> str:
        if name.startswith("_"):
            raise AttributeError(name)
        return self.prefix + name.replace("_", ":")

    def router(self, router_id: str) -> str:
        """``router:<id>``: that router's view."""
        return f"{self.prefix}router:{router_id}"

    def adding(self, address: str) -> str:
        """``adding:<ip>:<port>/<path>``: a server at that address is being added (``CLAIM_ADDRESSES``)."""
        return f"{self.prefix}adding:{address}"

    def marked(self, router_id: str) -> str:
        """``marked:<id>``: the newest version epoch that router applied with its streams' spans marked."""
        return f"{self.prefix}marked:{router_id}"

    def load(self, router_id: str) -> str:
        """``load:<id>``: that router's in-flight share."""
        return f"{self.prefix}load:{router_id}"


def encode_pin(replica: str, start_version: int | None) -> str:
    """``"<replica>|<start version>"`` (empty version: none)."""
    return f"{replica}|{'' if start_version is None else start_version}"


def decode_pin(value: str | None) -> tuple[str | None, int | None]:
    """``(replica, start_version)`` of a stored pin; ``(None, None)`` for none or garbage."""
    if not value or "|" not in value:
        return None, None
    replica, _, version = value.rpartition("|")
    try:
        return replica or None, int(version) if version else None
    except ValueError:
        return replica or None, None


def parse_event(message: str) -> tuple[str, list[str]]:
    """``(kind, fields)`` of a message on the ``events`` channel."""
    kind, *fields = message.split("\t")
    return kind, fields
