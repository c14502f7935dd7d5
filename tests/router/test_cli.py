"""The CLI: flags come from the config dataclasses; config mistakes exit 2 before anything starts."""

from __future__ import annotations

import socket

import pytest

from router.cli import _config, _parser, main


def test_flags_override_config_fields():
    args = _parser().parse_args(["serve", "--port", "9123", "--policy", "round_robin", "--admission", "false"])
    cfg = _config(args)
    assert (cfg.router.port, cfg.router.policy, cfg.router.admission) == (9123, "round_robin", False)


def test_policy_fields_are_flags_too(capsys):
    args = _parser().parse_args(["serve", "--policy-parked-fraction", "0.25", "--policy-max-queue-per-replica", "8",
                                 "--policy", "least_load"])
    cfg = _config(args)
    assert (cfg.policy.parked_fraction, cfg.policy.max_queue_per_replica, cfg.router.policy) == (0.25, 8, "least_load")
    assert main(["serve", "--policy-parked-fraction", "1.5"]) == 2
    assert "policy.parked_fraction" in capsys.readouterr().err


def test_demo_has_no_port_or_policy_flags():
    from bench.demo_cli import parser

    with pytest.raises(SystemExit):
        parser().parse_args(["--port", "1"])
    args = parser().parse_args(["--grpo-num-prompts", "2", "--agent-turns", "3"])
    assert args.grpo_num_prompts == 2 and args.agent_turns == 3
    with pytest.raises(SystemExit):
        _parser().parse_args(["demo"])  # the router's CLI does not import bench/


def test_config_errors_exit_2(capsys):
    assert main(["serve", "--policy", "bogus"]) == 2
    assert "router.policy" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert f"router.port {port}" in capsys.readouterr().err


def test_num_replicas_below_1_is_a_config_error_naming_the_flag(capsys):
    assert _config(_parser().parse_args(["serve", "--num-replicas", "1"])).replicas.num_replicas == 1
    assert _config(_parser().parse_args(["serve"])).replicas.num_replicas == 2  # the config's
    for value in ("0", "-3"):
        assert main(["serve", "--num-replicas", value, "--port", "0"]) == 2
        assert capsys.readouterr().err == f"rollout-router: config error: --num-replicas: must be >= 1, got {value}\n"


def test_version_comes_from_the_package_metadata(capsys, monkeypatch):
    from importlib.metadata import version

    import router

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"rollout-router {version('rollout-router')}\n"
    monkeypatch.setattr(router, "DISTRIBUTION", "rollout-router-not-installed")
    assert router.package_version() == "unknown"


def test_boolean_flags_say_they_take_true_or_false(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--help"])
    help_text = capsys.readouterr().out
    assert "--admission {true,false}" in help_text and "--tenant-header {true,false}" in help_text
    assert _config(_parser().parse_args(["serve", "--admission", "off"])).router.admission is False


def test_choice_flags_list_their_choices_in_help(capsys):
    """Literal-typed config fields show their values; a value outside them stays a config error
    naming the YAML path (exit 2), as in a YAML file."""
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--help"])
    help_text = capsys.readouterr().out
    for flag in ("--event-loop {uvloop,asyncio}", "--state {memory,redis}", "--weight-update-mode {rolling,all}",
                 "--policy {prefix_affinity,round_robin,least_load}",
                 "--weight-update-policy {flush,keep,salt,keep+salt}"):
        assert flag in help_text, flag
    assert _config(_parser().parse_args(["serve", "--event-loop", "asyncio"])).router.event_loop == "asyncio"
    assert main(["serve", "--event-loop", "trio"]) == 2
    assert "router.event_loop" in capsys.readouterr().err


def test_help_leaves_spec_references_out():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "router.cli", "serve", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "Admission control: hold requests" in out and "Cache policy at weight updates:" in out
    assert "DESIGN rule" not in out and "(seed 0" not in out


def test_help_shows_docstring_literals_as_plain_text():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "router.cli", "serve", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "``" not in out, [line for line in out.splitlines() if "``" in line]
    assert "projected KV usage would pass policy.high_watermark" in " ".join(out.split())
    assert "gives no max_tokens." in out
    assert "Separate from admin_token. (default: {})" in " ".join(out.split())  # a default_factory's value


def test_a_bad_config_file_prints_one_line_and_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("replicas:\n  kv_cache_space_gib: 1.5\n")
    assert main(["serve", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err == "rollout-router: config error: replicas.kv_cache_space_gib: must be a whole number of GiB, got 1.5\n"


def test_new_edge_fields_have_flags():
    args = _parser().parse_args(["serve", "--max-n", "8", "--tenant-header", "true", "--body-timeout-s", "5"])
    cfg = _config(args)
    assert (cfg.router.max_n, cfg.router.tenant_header, cfg.router.body_timeout_s) == (8, True, 5.0)


def test_number_flags_are_typed_by_argparse_and_must_be_finite(capsys):
    """Flags arrive as strings; argparse's int/float types convert them before the strict config sees them."""
    args = _parser().parse_args(["serve", "--policy-queue-timeout-s", "5", "--policy-max-queue-per-replica", "0",
                                 "--request-timeout-s", "1e3"])
    cfg = _config(args)
    assert (cfg.policy.queue_timeout_s, cfg.policy.max_queue_per_replica, cfg.router.request_timeout_s) == (5.0, 0, 1e3)
    for flag, value, name in (("--policy-queue-timeout-s", "inf", "policy.queue_timeout_s"),
                              ("--request-timeout-s", "nan", "router.request_timeout_s")):
        assert main(["serve", flag, value]) == 2
        assert capsys.readouterr().err == f"rollout-router: config error: {name}: must be a finite number, got {value}\n"
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--policy-max-queue-per-replica", "true"])
    assert "invalid int value: 'true'" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "expected"), [
    ("sk-a=team-a,sk-b", {"sk-a": "team-a", "sk-b": None}),
    ('{"sk-a": "team-a", "sk-b": null}', {"sk-a": "team-a", "sk-b": None}),
])
def test_api_keys_flag_takes_pairs_or_json(flag, expected):
    cfg = _config(_parser().parse_args(["serve", "--api-keys", flag]))
    assert cfg.router.api_keys == expected  # before, every value was refused: 'must be a mapping'


@pytest.mark.parametrize("flag", ["=team", "sk-a=", '{"sk-a": 5}', '{"a": '])
def test_a_malformed_api_keys_flag_is_a_usage_error(flag, capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["serve", "--api-keys", flag])
    assert exc.value.code == 2 and "--api-keys" in capsys.readouterr().err


def test_serve_holds_its_port_from_before_the_replicas_start():
    # bound before the replicas start (minutes): a later bind(0) or a plain bind cannot take it,
    # and a client is refused at once rather than left hanging while nothing serves
    from router.cli import _reserve_port

    with _reserve_port("127.0.0.1", 0) as held:
        port = held.getsockname()[1]
        with socket.socket() as other:
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", port))
        with socket.socket() as client, pytest.raises(ConnectionRefusedError):
            client.connect(("127.0.0.1", port))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"router.port {port} on 127.0.0.1 is not free"):
            _reserve_port("127.0.0.1", port)
    with pytest.raises(OSError, match="router.host 'no-such-host.invalid' cannot be bound"):
        _reserve_port("no-such-host.invalid", 0)
