"""Every `vllm serve` flag and `LLM(...)` argument of vLLM 0.34.0 is implemented or refused.

The flag list comes from tests/fixtures/vllm/serve_flags-0.34.0.json (recorded from vLLM's own
argument parser). A flag that is neither implemented by `pagoda serve` nor in the refusal table
with a reason fails here; a refused flag must end the command with an error naming it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pagoda.engine.args import EngineArgs
from pagoda.entrypoints import vllm_compat as vc
from pagoda.entrypoints.openai import cli as serve_cli

DATA = json.loads(
    (Path(__file__).parents[2] / "fixtures" / "vllm" / "serve_flags-0.34.0.json").read_text()
)
FLAGS = DATA["serve_flags"]
TABLES = {
    "implemented": set(vc.IMPLEMENTED),
    "value-checked": set(vc.VALUE_CHECKED),
    "equivalent": set(vc.EQUIVALENT),
    "refused": set(vc.REFUSED),
}
OURS = (vc._Refuse, vc._Equivalent, vc._Checked)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", exit_on_error=False)
    serve_cli.register(parser.add_subparsers(dest="command", required=True))
    return parser


def _serve_parser() -> argparse.ArgumentParser:
    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_recorded_list_is_vllm_0_34():
    assert DATA["vllm_version"] == "0.34.0"
    assert len(FLAGS) > 300  # vllm serve --help's flags (hidden ones left out)


def test_every_flag_is_in_exactly_one_table():
    dests = {f["dest"] for f in FLAGS}
    for f in FLAGS:
        homes = [name for name, table in TABLES.items() if f["dest"] in table]
        assert len(homes) == 1, (f["flags"], homes)
    for name, table in TABLES.items():
        stale = table - dests
        assert not stale, f"{name} lists flags vLLM 0.34.0 does not have: {sorted(stale)}"
    for table in (vc.VALUE_CHECKED, vc.EQUIVALENT, vc.REFUSED):
        for dest, entry in table.items():
            assert entry[-1].strip(), f"{dest}: no reason given"


def test_every_flag_spelling_parses_with_vllms_meaning_or_a_named_refusal():
    actions = _serve_parser()._option_string_actions
    for f in FLAGS:
        for flag in f["flags"]:
            assert flag in actions, f"{flag} is unknown to pagoda serve"
            action = actions[flag]
            if f["dest"] in vc.IMPLEMENTED:
                assert not isinstance(action, OURS), f"{flag} should be implemented"
            elif f["dest"] in vc.REFUSED:
                assert isinstance(action, vc._Refuse), flag


@pytest.mark.parametrize(
    "flag", sorted({fl for f in FLAGS if f["dest"] in vc.REFUSED for fl in f["flags"]})
)
def test_refused_flag_is_an_error_naming_it(flag, capsys):
    args = ["serve", flag] if _takes_no_value(flag) else ["serve", flag, "1"]
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag} (a vLLM flag) is not supported by pagoda: " in err, err


def _takes_no_value(flag: str) -> bool:
    return next(f for f in FLAGS if flag in f["flags"])["nargs"] == 0


def test_value_checked_flags(capsys):
    ns = _parser().parse_args(["serve", "-pp", "1", "--scheduling-policy", "fcfs"])
    assert ns.vllm_pipeline_parallel_size == "1" and ns.vllm_scheduling_policy == "fcfs"
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--pipeline-parallel-size", "2"])
    err = capsys.readouterr().err
    assert "--pipeline-parallel-size 2 is not supported by pagoda" in err
    assert "pipeline parallelism is not implemented" in err and "accepted: 1" in err


def test_equivalent_flags_are_noted():
    ns = _parser().parse_args(["serve", "--disable-custom-all-reduce"])
    assert ns.vllm_flag_notes == [
        "--disable-custom-all-reduce: one device: there is no all-reduce to customise"
    ]


def test_served_model_name_takes_several_names():
    ns = _parser().parse_args(["serve", "default", "--served-model-name", "a", "b"])
    assert ns.model == "default" and ns.served_model_name == ["a", "b"]
    from pagoda.entrypoints.openai.api_server import ServerArgs

    args = serve_cli.server_args_from(ns, ServerArgs)
    assert args.served_model_names == ("a", "b")


def test_human_readable_sizes_and_json_flags():
    ns = _parser().parse_args(
        [
            "serve",
            "--max-model-len",
            "2k",
            "--kv-cache-memory-bytes",
            "1G",
            "--allowed-origins",
            '["https://app.example"]',
            "--override-generation-config",
            '{"temperature": 0.5}',
        ]
    )
    assert ns.max_model_len == 2000 and ns.kv_cache_memory == 1 << 30
    assert ns.allowed_origins == ["https://app.example"]
    assert ns.override_generation_config == {"temperature": 0.5}
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--allowed-origins", "https://app.example"])


def test_llm_keyword_arguments():
    """Each of vLLM's LLM(...) arguments: pagoda's, or a clear error naming it."""
    supported = EngineArgs.field_names() | {
        "tensor_parallel_size",
        "trust_remote_code",
        "print_memory_report",
        "kv_cache_memory_bytes",
    }
    tables = (vc.VALUE_CHECKED, vc.EQUIVALENT, vc.REFUSED, vc.LLM_ONLY_REFUSED, vc.LLM_SERVER_ONLY)
    for name in set(DATA["llm_parameters"]) | set(DATA["engine_args_fields"]):
        assert name in supported or any(name in t for t in tables), name
    with pytest.raises(ValueError, match=r"LLM\(enable_sleep_mode=...\) \(a vLLM argument\)"):
        vc.check_llm_kwargs({"enable_sleep_mode": True}, supported)
    with pytest.raises(ValueError, match="accepted: fcfs"):
        vc.check_llm_kwargs({"scheduling_policy": "priority"}, supported)
    assert vc.check_llm_kwargs({"scheduling_policy": "fcfs", "seed": 1}, supported) == {"seed": 1}
    with pytest.raises(TypeError, match="unknown argument 'max_num_sequences'"):
        vc.check_llm_kwargs({"max_num_sequences": 4}, supported)
