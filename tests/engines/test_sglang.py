"""The SGLang launcher's command line: our flags, passthrough rules, errors, and every flag we
emit checked against the CLI of the released sglang wheel (read, never imported or committed)."""

from __future__ import annotations

import ast
import sys

import pytest

from miles.engines.sglang import SGLangServerArgs, build_command, passthrough_flags


def _full_args(**kw) -> SGLangServerArgs:
    """Every flag Miles can set, switched on."""
    return SGLangServerArgs(
        model_path="/ckpt/step-10", port=30000, tp_size=4, dp_size=2, attn_dp_size=2, ep_size=4,
        mem_fraction_static=0.7, enable_routed_experts=True, weight_version="10",
        enable_memory_saver=True, base_gpu_id=4, nnodes=2, node_rank=1,
        dist_init_addr="10.0.0.1:5000", **kw)


def test_command_line_has_our_flags():
    cmd = build_command(_full_args())
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    line = " ".join(cmd)
    for expected in ["--model-path /ckpt/step-10", "--host 127.0.0.1", "--port 30000",
                     "--tp-size 4", "--dp-size 2", "--attn-dp-size 2", "--ep-size 4",
                     "--mem-fraction-static 0.7", "--enable-return-routed-experts",
                     "--weight-version 10", "--enable-memory-saver", "--base-gpu-id 4",
                     "--nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.1:5000"]:
        assert expected in line


def test_defaults_leave_sglang_defaults_alone():
    cmd = build_command(SGLangServerArgs(model_path="m", port=1234))
    assert cmd[3:] == ["--model-path", "m", "--host", "127.0.0.1", "--port", "1234",
                       "--tp-size", "1"]


def test_passthrough_rules():
    flags = passthrough_flags({
        "chunked_prefill_size": 4096,          # scalar
        "schedule-policy": "lpm",              # dashes accepted as written
        "enable_metrics": True,                # store_true
        "disable_radix_cache": False,          # omitted: SGLang's default
        "cuda_graph_max_bs": None,             # omitted
        "cuda_graph_bs_decode": [1, 2, 4],     # nargs="+"
        "json_model_override_args": {"rope_scaling": {"factor": 2.0}},  # JSON string
        "watchdog_timeout": 600.5,
    })
    assert flags == ["--chunked-prefill-size", "4096", "--schedule-policy", "lpm",
                     "--enable-metrics", "--cuda-graph-bs-decode", "1", "2", "4",
                     "--json-model-override-args", '{"rope_scaling":{"factor":2.0}}',
                     "--watchdog-timeout", "600.5"]
    # Passthrough comes after our flags, so the table can never shadow them.
    cmd = build_command(SGLangServerArgs(model_path="m", port=1, extra_args={"enable_metrics": True}))
    assert cmd[-1] == "--enable-metrics"


@pytest.mark.parametrize("table, message", [
    ({"port": 1}, "engine.sglang.port: Miles sets this flag itself; use the field 'port'"),
    ({"tensor-parallel-size": 2}, "engine.sglang.tensor-parallel-size: .* field 'tp_size'"),
    ({"enable_dp_attention": True}, "field 'attn_dp_size'"),
    ({"enable_return_routed_experts": True}, "field 'enable_routed_experts'"),
    ({"cuda_graph_bs": []}, "engine.sglang.cuda_graph_bs: empty list"),
    ({"cuda_graph_bs": [{"a": 1}]}, "engine.sglang.cuda_graph_bs: list items must be"),
    ({"--tp": 2}, "engine.sglang.--tp: not a flag name"),
])
def test_passthrough_errors_name_the_key(table, message):
    with pytest.raises(ValueError, match=message):
        SGLangServerArgs(model_path="m", port=1, extra_args=table)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp_size=0), "sglang.tp_size: expected an integer >= 1, got 0"),
    (dict(mem_fraction_static=1.5), r"sglang.mem_fraction_static: expected a value in \(0, 1\)"),
    (dict(nnodes=2), "sglang.dist_init_addr: required when nnodes=2"),
    (dict(node_rank=3, nnodes=2, dist_init_addr="h:1"), "sglang.node_rank: expected 0 <="),
])
def test_field_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SGLangServerArgs(model_path="m", port=1, **kwargs)


def _sglang_cli_flags(wheel) -> set[str]:
    """Every `--flag` sglang's launch_server accepts, from its dataclass fields and the flags
    registered by hand in server_args.py (mirrors arg_utils.add_cli_args_from_dataclass)."""
    flags: set[str] = set()
    field_files = [n for n in wheel.members()
                   if n.startswith("sglang/srt/arg_groups/fields/") and n.endswith(".py")]
    for member in field_files:
        for node in ast.walk(ast.parse(wheel.read(member))):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            arg = next((n for n in ast.walk(node.annotation) if isinstance(n, ast.Call)
                        and getattr(n.func, "id", None) == "Arg"), None)
            keywords = {k.arg: k.value for k in arg.keywords} if arg else {}
            if "no_cli" in keywords and ast.literal_eval(keywords["no_cli"]):
                continue
            cli_name = keywords.get("cli_name")
            flags.add(ast.literal_eval(cli_name) if cli_name is not None
                      else "--" + node.target.id.replace("_", "-"))
            if "aliases" in keywords:
                flags.update(ast.literal_eval(keywords["aliases"]))
    for node in ast.walk(ast.parse(wheel.read("sglang/srt/server_args.py"))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags.update(a.value for a in node.args if isinstance(a, ast.Constant)
                         and str(a.value).startswith("--"))
    return flags


def test_every_flag_we_emit_exists_in_the_pinned_sglang(sglang_wheel):
    known = _sglang_cli_flags(sglang_wheel)
    assert len(known) > 300, "the field parser found too few flags; did sglang move them?"
    ours = {a for a in build_command(_full_args())[3:] if a.startswith("--")}
    missing = sorted(ours - known)
    assert not missing, f"not flags of sglang {sglang_wheel.version}: {missing}"
    # Sanity: the deprecated DP-attention flag is gone from fields but kept by hand; a made-up
    # flag is not accepted.
    assert "--enable-dp-attention" in known and "--no-such-flag" not in known


@pytest.mark.parametrize("inherited", [None, "1", "true", "false"])
def test_launch_env_forces_temperature_scaled_logprobs(monkeypatch, inherited):
    """SGLang reports temperature-1 log-probs when SGLANG_RETURN_ORIGINAL_LOGPROB is true; the
    launcher turns it off in the child whatever the caller's environment or `env=` holds."""
    from miles.engines.sglang import SGLangServer
    if inherited is None:
        monkeypatch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB", raising=False)
    else:
        monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", inherited)
    monkeypatch.setenv("MILES_TEST_KEEP", "kept")
    args = SGLangServerArgs(model_path="m", port=1234)
    inherited_env = SGLangServer(args).process.env
    assert inherited_env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "false"
    assert inherited_env["MILES_TEST_KEEP"] == "kept"
    given = SGLangServer(args, env={"SGLANG_RETURN_ORIGINAL_LOGPROB": "True", "A": "b"}).process.env
    assert given == {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false", "A": "b"}


def test_the_cluster_recipe_launches_engines_sglang_accepts(sglang_wheel, tmp_path):
    """recipes/grpo_sglang_cluster.toml: each engine's command line, from the recipe as the fleet
    builds it, uses only flags of the pinned sglang, and the engines tile the node's GPUs."""
    from miles.config import load_recipe
    from miles.engines.sglang import recipe_server_args
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    recipe = load_recipe(root / "recipes" / "grpo_sglang_cluster.toml")
    known = _sglang_cli_flags(sglang_wheel)
    gpus = []
    for i in range(recipe.engine.num_engines):
        args = recipe_server_args(recipe, i, 30000 + i)
        cmd = build_command(args)
        flags = {a for a in cmd[3:] if a.startswith("--")}
        assert not sorted(flags - known), sorted(flags - known)
        line = " ".join(cmd)
        assert f"--tp-size {recipe.engine.tp_size}" in line and "--chunked-prefill-size 8192" in line
        assert f"--context-length {recipe.engine.context_length}" in line
        gpus += [args.base_gpu_id + k for k in range(args.tp_size * args.dp_size)]
    assert gpus == list(range(8))      # 4 engines x TP 2: every GPU of the node once
