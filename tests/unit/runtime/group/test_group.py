"""A host's place in a multi-host group: from CF_* variables, LeaderWorkerSet's variables or flags, to
the leader's and the workers' vLLM commands; the refusals; the doctor's report; vLLM's own parser."""

from __future__ import annotations

import argparse
import contextlib
import io
import shlex
import socket
from pathlib import Path

import pytest

from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.gpu.fake import FakeGpuBackend, host
from carbonforge_runtime.recipes import load_recipes, recipe_dirs
from carbonforge_runtime.recipes.loader import resolve
from carbonforge_runtime.runtime.doctor.checks import run_checks
from carbonforge_runtime.runtime.doctor.collect import collect_facts
from carbonforge_runtime.runtime.doctor.facts import DOCTOR, DoctorRequest
from carbonforge_runtime.runtime.doctor.fake import FixedProbes
from carbonforge_runtime.runtime.doctor.preflight import GroupHardwareMismatch
from carbonforge_runtime.runtime.doctor.probes import SystemProbes
from carbonforge_runtime.runtime.group.placement import GroupFlags, hardware_remedy, resolve_group
from carbonforge_runtime.runtime.planning.command import engine_args
from carbonforge_runtime.runtime.planning.plan import ServeOptions, build_plan
from carbonforge_runtime.runtime.serve import launch as serve_module
from carbonforge_runtime.runtime.serve.launch import prepare, serve
from carbonforge_runtime.settings import load_settings

MULTI_KEY = "qwen3.6-27b:fp8:agentic:2xh100x8"
SINGLE_KEY = "qwen3.6-27b:fp8:agentic:h100x8"
LWS_WORKER = {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "10.1.2.3"}
LWS_LEADER = {**LWS_WORKER, "LWS_WORKER_INDEX": "0"}
CF_WORKER = {"CF_NNODES": "2", "CF_NODE_RANK": "1", "CF_MASTER_ADDR": "10.1.2.3"}
CF_LEADER = {**CF_WORKER, "CF_NODE_RANK": "0"}
GROUP_FLAGS = "--nnodes 2 --node-rank {rank} --master-addr 10.1.2.3 --master-port 29501"
RECIPES = load_recipes(recipe_dirs(None))
GROUP_SECRET = "the group's shared secret, 40 characters"


def plan_for(env: dict[str, str], **options: object) -> list[str]:
    """The launch command a host with ``env`` runs."""
    return build_plan(ServeOptions(**options), load_settings(env), RECIPES, env).launch.argv  # type: ignore[arg-type]


def dry_run(env: dict[str, str], capsys: pytest.CaptureFixture[str], **options: object) -> tuple[int, str]:
    full = {"CF_LOG_DIR": "/nonexistent/logs", "CF_GROUP_SECRET": GROUP_SECRET, **env}
    opts = ServeOptions(dry_run=True, skip_preflight=True, **options)  # type: ignore[arg-type]
    code = serve(opts, load_settings(full), full, FakeGpuBackend(host("h100", count=8)))
    return code, capsys.readouterr().out


@pytest.mark.parametrize("env", [LWS_WORKER, CF_LEADER], ids=["lws-worker", "cf-leader"])
def test_a_host_of_a_group_without_the_group_secret_is_refused_naming_the_file_variable(
        env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out = dry_run({**env, "CF_GROUP_SECRET": ""}, capsys, vllm_args=["--model", "org/model"])
    assert code == 2
    assert "a group of more than one host needs a group secret" in out and "CF_GROUP_SECRET_FILE" in out
    _, alone = dry_run({"CF_GROUP_SECRET": ""}, capsys, vllm_args=["--model", "org/model"])
    assert "group secret" not in alone  # a host alone needs none


def test_the_group_secret_never_reaches_the_engine() -> None:
    env = {**CF_LEADER, "CF_GROUP_SECRET": GROUP_SECRET, "CF_GROUP_SECRET_FILE": "/run/secrets/group",
           "CF_ENGINE_ENV_PASS": "CF_GROUP_SECRET,CF_GROUP_SECRET_FILE"}
    plan = build_plan(ServeOptions(context_key=MULTI_KEY), load_settings(env), RECIPES, env)
    engine_env = plan.launch.engine_env(plan.launch.contract)
    assert "CF_GROUP_SECRET" not in engine_env and "CF_GROUP_SECRET_FILE" not in engine_env
    assert GROUP_SECRET not in " ".join([*plan.launch.argv, *engine_env.values()])


# ---- where the place comes from ------------------------------------------------------------------

def test_leaderworkerset_variables_place_a_worker() -> None:
    group = resolve_group(load_settings(LWS_WORKER))
    assert group is not None and (group.nnodes, group.rank, group.master_addr) == (2, 1, "10.1.2.3")
    assert not group.leader and group.master_port == 29501 and group.join_timeout_s == 300
    assert group.sources == ("LWS_GROUP_SIZE", "LWS_WORKER_INDEX", "LWS_LEADER_ADDRESS")


def test_cf_variables_win_over_leaderworkerset_and_flags_win_over_both() -> None:
    env = {**LWS_WORKER, "CF_NODE_RANK": "0", "CF_MASTER_PORT": "31000", "CF_JOIN_TIMEOUT_S": "45"}
    group = resolve_group(load_settings(env))
    assert group is not None and group.leader and group.master_port == 31000 and group.join_timeout_s == 45
    flagged = resolve_group(load_settings(env), GroupFlags(nnodes=3, node_rank=2, master_addr="leader.example"))
    assert flagged is not None and (flagged.nnodes, flagged.rank, flagged.master_addr) == (3, 2, "leader.example")


def test_no_group_variables_or_a_group_of_one_is_a_host_alone() -> None:
    assert resolve_group(load_settings({})) is None
    assert resolve_group(load_settings({"CF_NNODES": "1", "CF_NODE_RANK": "0"})) is None


@pytest.mark.parametrize(("env", "problem", "fix"), [
    ({"CF_NNODES": "2", "CF_MASTER_ADDR": "a"}, "its rank is not set", "CF_NODE_RANK"),
    ({"CF_NNODES": "2", "CF_NODE_RANK": "2", "CF_MASTER_ADDR": "a"}, "outside the group of 2", "from 0"),
    ({"CF_NNODES": "2", "CF_NODE_RANK": "1"}, "leader's address is not set", "CF_MASTER_ADDR"),
    ({"CF_NODE_RANK": "1"}, "group size is not set", "CF_NNODES"),
])
def test_a_place_that_does_not_add_up_is_refused_naming_the_variable(env: dict[str, str], problem: str,
                                                                     fix: str) -> None:
    with pytest.raises(UsageError) as refused:
        resolve_group(load_settings(env))
    assert problem in refused.value.message and fix in refused.value.remedy


# ---- the commands, in both launch modes ------------------------------------------------------------

@pytest.mark.parametrize("env", [LWS_WORKER, CF_WORKER], ids=["lws", "cf"])
def test_the_dry_run_of_a_worker_prints_a_headless_command(env: dict[str, str],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, out = dry_run({**env, "CARBONFORGE_LICENSE_KEY": ""}, capsys, context_key=MULTI_KEY)
    assert code == 4  # premium without a licence: the plan is printed, the launch would be refused
    command = out.split("vLLM command:", 1)[1]
    assert "-m carbonforge_runtime.engine.headless Qwen/Qwen3.6-27B-FP8 " in command
    assert f"{GROUP_FLAGS.format(rank=1)} --distributed-timeout-seconds 300 --headless" in command
    assert "--middleware" not in command  # the API server's alone
    assert "group:              worker, rank 1 of 2 hosts; leader 10.1.2.3:29501" in out
    assert "API:                none on a worker" in out


@pytest.mark.parametrize("env", [LWS_LEADER, CF_LEADER], ids=["lws", "cf"])
def test_the_dry_run_of_the_leader_prints_the_api_server_without_headless(
        env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    _, out = dry_run(env, capsys, context_key=MULTI_KEY)
    command = out.split("vLLM command:", 1)[1]
    assert "-m vllm.entrypoints.openai.api_server " in command and "--middleware" in command
    assert GROUP_FLAGS.format(rank=0) in command and "--headless" not in command
    assert "hosts:              2 hosts x 8 GPUs; data parallel across hosts" in out


@pytest.mark.parametrize(("env", "rank"), [(LWS_WORKER, 1), (CF_WORKER, 1), (LWS_LEADER, 0), (CF_LEADER, 0)],
                         ids=["lws-worker", "cf-worker", "lws-leader", "cf-leader"])
def test_the_full_override_is_placed_the_same_way(env: dict[str, str], rank: int,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    argv = plan_for(env, vllm_args=["org/model", "--tensor-parallel-size", "2"])
    line = shlex.join(argv)
    assert GROUP_FLAGS.format(rank=rank) in line and ("--headless" in argv) == (rank == 1)
    # the leader's API server takes --model; a worker's `vllm serve` takes the model first
    assert engine_args(argv)[:2] == (["--model", "org/model"] if rank == 0 else ["org/model", "--tensor-parallel-size"])
    # and the dry run prints that command
    code, out = dry_run(env, capsys, vllm_args=["org/model", "--tensor-parallel-size", "2"])
    assert code == 0, out
    command = out.split("vLLM command:", 1)[1]
    assert GROUP_FLAGS.format(rank=rank) in command and ("--headless" in command) == (rank == 1)
    assert ("engine.headless org/model " in command) == (rank == 1)
    assert ("--model org/model" in command) == (rank == 0)


def test_flags_place_the_host_as_the_variables_do() -> None:
    argv = plan_for({}, vllm_args=["org/model"], nnodes=2, node_rank=1, master_addr="10.1.2.3")
    assert GROUP_FLAGS.format(rank=1) in shlex.join(argv) and argv[-1] == "--headless"


def test_a_single_host_key_in_a_group_is_refused() -> None:
    with pytest.raises(UsageError) as refused:
        plan_for({"CF_NNODES": "2", "CF_NODE_RANK": "0", "CF_MASTER_ADDR": "a"}, context_key=SINGLE_KEY)
    assert f"{SINGLE_KEY} is a single-host recipe" in refused.value.message
    assert "2xh100x8" in refused.value.remedy and "unset CF_NNODES" in refused.value.remedy
    from typer.testing import CliRunner

    from carbonforge_runtime.cli.main import app

    env = {"CF_NNODES": "2", "CF_NODE_RANK": "0", "CF_MASTER_ADDR": "a"}
    result = CliRunner().invoke(app, ["serve", "--context-key", SINGLE_KEY, "--dry-run"], env=env)
    assert result.exit_code == 2 and "is a single-host recipe" in result.output, result.output
    assert "Traceback" not in result.output


def test_a_multi_host_key_needs_its_group() -> None:
    with pytest.raises(UsageError) as alone:
        plan_for({}, context_key=MULTI_KEY)
    assert "spans 2 hosts" in alone.value.message and "CF_NNODES=2" in alone.value.remedy
    with pytest.raises(UsageError) as three:
        plan_for({"CF_NNODES": "3", "CF_NODE_RANK": "0", "CF_MASTER_ADDR": "a"}, context_key=MULTI_KEY)
    assert "the group has 3" in three.value.message


# ---- a host of a group on the wrong GPUs ------------------------------------------------------------

@pytest.fixture
def no_licence_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The premium recipes pass the licence gate, so that the hardware check is what decides."""
    monkeypatch.setattr(serve_module, "check_licence", lambda *args, **kwargs: None)


@pytest.mark.usefixtures("no_licence_gate")
@pytest.mark.parametrize("env", [LWS_WORKER, LWS_LEADER, CF_WORKER, CF_LEADER],
                         ids=["lws-worker", "lws-leader", "cf-worker", "cf-leader"])
def test_a_host_of_a_group_on_other_gpus_is_refused_with_the_doctors_remedy(env: dict[str, str]) -> None:
    two_l4 = FakeGpuBackend(host("l4", count=2))
    with pytest.raises(GroupHardwareMismatch) as refused:
        prepare(ServeOptions(context_key=MULTI_KEY), load_settings(env), env, two_l4)
    assert refused.value.exit_code == 3  # the --strict-hardware refusal's code, without the flag
    role = "leader, rank 0" if env in (LWS_LEADER, CF_LEADER) else "worker, rank 1"
    assert f"this host ({role} of 2 hosts) does not have the GPUs of 2xh100x8" in refused.value.message
    assert "needs 8 GPU(s), 2 detected" in refused.value.message and "NVIDIA L4" in refused.value.message
    assert refused.value.remedy == hardware_remedy(resolve(MULTI_KEY, RECIPES))
    assert "8 H100 GPU(s)" in refused.value.remedy
    # the doctor on the same host FAILs the comparison with the same remedy
    doctor = collect_facts(DoctorRequest(mode=DOCTOR, context_key=MULTI_KEY), load_settings(env), env, two_l4,
                           probes=FixedProbes())
    hardware = [c for c in run_checks(doctor) if c.name == "recipe.hardware"]
    assert hardware and all(c.status == "FAIL" and c.remedy == refused.value.remedy for c in hardware)


@pytest.mark.usefixtures("no_licence_gate")
def test_one_wrong_gpu_is_enough_to_refuse_a_host_of_a_group() -> None:
    """Eight GPUs of the right count but another memory size: still refused, not a warning."""
    h200 = FakeGpuBackend(host("h200", count=8))
    with pytest.raises(GroupHardwareMismatch, match="tuned for H100, detected NVIDIA H200"):
        prepare(ServeOptions(context_key=MULTI_KEY), load_settings(LWS_WORKER), LWS_WORKER, h200)
    no_gpu = FakeGpuBackend(host(None))
    with pytest.raises(GroupHardwareMismatch, match="no GPU can be inspected"):
        prepare(ServeOptions(context_key=MULTI_KEY), load_settings(LWS_WORKER), LWS_WORKER, no_gpu)


@pytest.mark.usefixtures("no_licence_gate")
@pytest.mark.parametrize("env", [LWS_WORKER, CF_LEADER], ids=["lws-worker", "cf-leader"])
def test_a_host_of_a_group_on_the_recipes_gpus_passes(env: dict[str, str]) -> None:
    env = {**env, "CF_GROUP_SECRET": GROUP_SECRET}
    right = FakeGpuBackend(host("h100", count=8))
    prepared = prepare(ServeOptions(context_key=MULTI_KEY), load_settings(env), env, right)
    assert prepared.hardware_problems == [] and prepared.verdicts.refusals == []
    doctor = collect_facts(DoctorRequest(mode=DOCTOR, context_key=MULTI_KEY), load_settings(env), env, right,
                           probes=FixedProbes())
    assert [c.status for c in run_checks(doctor) if c.name == "recipe.hardware"] == ["OK"]


@pytest.mark.usefixtures("no_licence_gate")
def test_a_host_alone_on_other_gpus_still_only_warns() -> None:
    two_l4 = FakeGpuBackend(host("l4", count=2))
    prepared = prepare(ServeOptions(context_key=SINGLE_KEY), load_settings({}), {}, two_l4)
    assert prepared.hardware_problems and prepared.verdicts.refusals == []
    doctor = collect_facts(DoctorRequest(mode=DOCTOR, context_key=SINGLE_KEY), load_settings({}), {}, two_l4,
                           probes=FixedProbes())
    statuses = {c.detail: c.status for c in run_checks(doctor) if c.name == "recipe.hardware"}
    assert statuses["the recipe is tuned for H100, detected NVIDIA L4"] == "WARN"
    assert "--strict-hardware refuses instead" in next(c.remedy for c in run_checks(doctor)
                                                         if c.status == "WARN" and c.name == "recipe.hardware")


@pytest.mark.usefixtures("no_licence_gate")
def test_the_dry_run_of_a_worker_on_other_gpus_says_a_launch_would_be_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    full = {"CF_LOG_DIR": "/nonexistent/logs", **LWS_WORKER}
    code = serve(ServeOptions(dry_run=True, skip_preflight=True, context_key=MULTI_KEY), load_settings(full), full,
                 FakeGpuBackend(host("l4", count=2)))
    out = capsys.readouterr().out
    assert code == 3
    assert "hardware:           REFUSED (a host of a multi-host group): a launch would not start" in out
    assert "fix: run every host of the group on 8 H100 GPU(s)" in out


@pytest.mark.parametrize("extra", [["--nnodes", "2"], ["--headless"], ["--node-rank=1"], ["--master-addr", "x"]])
def test_group_flags_among_the_vllm_arguments_are_refused(extra: list[str]) -> None:
    with pytest.raises(UsageError) as refused:
        plan_for(CF_LEADER, context_key=MULTI_KEY, vllm_args=extra)
    assert "places this host in its group itself" in refused.value.message
    with pytest.raises(UsageError):
        plan_for({"CF_VLLM_EXTRA_ARGS": " ".join(extra)}, vllm_args=["org/model"])


def test_a_group_never_pins_vllm_to_the_loopback_address() -> None:
    alone = build_plan(ServeOptions(vllm_args=["org/model"]), load_settings({}), RECIPES, {})
    assert alone.launch.env.get("VLLM_HOST_IP") == "127.0.0.1"
    for env in (CF_LEADER, CF_WORKER):
        plan = build_plan(ServeOptions(vllm_args=["org/model"]), load_settings(env), RECIPES, env)
        assert "VLLM_HOST_IP" not in plan.launch.env


# ---- vLLM 0.32's own parsers take both commands ------------------------------------------------------

def test_vllms_parsers_read_the_leader_and_worker_commands() -> None:
    pytest.importorskip("vllm")
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def parse(parser: argparse.ArgumentParser, args: list[str]) -> argparse.Namespace:
        with contextlib.redirect_stderr(io.StringIO()):
            return parser.parse_args(args)

    leader = engine_args(plan_for(CF_LEADER, vllm_args=["org/model", "--tensor-parallel-size", "2"]))
    namespace = parse(make_arg_parser(FlexibleArgumentParser()), leader)
    assert (namespace.nnodes, namespace.node_rank, namespace.master_addr) == (2, 0, "10.1.2.3")
    assert namespace.distributed_timeout_seconds == 300

    cli = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(cli.add_subparsers(dest="command"))
    worker = engine_args(plan_for(CF_WORKER, vllm_args=["org/model", "--tensor-parallel-size", "2"]))
    namespace = parse(cli, ["serve", *worker])
    assert namespace.headless is True and (namespace.nnodes, namespace.node_rank) == (2, 1)
    assert worker[0] == "org/model"  # `vllm serve MODEL`: the model is positional there
    assert namespace.model_tag == "org/model" and namespace.master_port == 29501


# ---- the doctor ------------------------------------------------------------------------------------------

def doctor_lines(env: dict[str, str], probes: object) -> dict[str, tuple[str, str]]:
    facts = collect_facts(DoctorRequest(mode=DOCTOR), load_settings(env), env, FakeGpuBackend(host(None)),
                          probes=probes)  # type: ignore[arg-type]
    return {c.name: (c.status, c.detail + " | " + c.remedy) for c in run_checks(facts) if c.name.startswith("group")}


def test_the_doctor_reports_the_role_and_the_leader() -> None:
    assert doctor_lines({}, FixedProbes()) == {}
    leader = doctor_lines(LWS_LEADER, FixedProbes())
    assert leader["group.role"][0] == "OK" and "leader, rank 0 of 2" in leader["group.role"][1]
    assert "group.leader" not in leader
    worker = doctor_lines(LWS_WORKER, FixedProbes(leader_reach=("unreachable", "no answer within 3 s")))
    assert worker["group.role"][0] == "OK" and "worker, rank 1 of 2" in worker["group.role"][1]
    assert worker["group.leader"][0] == "WARN" and "10.1.2.3:29499 cannot be reached" in worker["group.leader"][1]
    bad = doctor_lines({"CF_NNODES": "2", "CF_NODE_RANK": "5", "CF_MASTER_ADDR": "a"}, FixedProbes())
    assert bad["group.role"][0] == "FAIL" and "outside the group" in bad["group.role"][1]


def test_the_doctor_fails_a_host_of_a_group_without_a_usable_secret_and_never_shows_it(tmp_path: Path) -> None:
    missing = doctor_lines(LWS_WORKER, FixedProbes())
    assert missing["group.secret"][0] == "FAIL" and "needs a group secret" in missing["group.secret"][1]
    assert "CF_GROUP_SECRET_FILE" in missing["group.secret"][1]
    short = tmp_path / "group.secret"
    short.write_text("too-short\n")
    assert "shorter than 16" in doctor_lines({**LWS_LEADER, "CF_GROUP_SECRET_FILE": str(short)},
                                             FixedProbes())["group.secret"][1]
    given = doctor_lines({**LWS_LEADER, "CF_GROUP_SECRET": GROUP_SECRET}, FixedProbes())
    assert given["group.secret"][0] == "OK" and GROUP_SECRET not in str(given)
    assert "group.secret" not in doctor_lines({"CF_NNODES": "1"}, FixedProbes())


def test_the_leader_probe_tells_open_from_refused() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        assert SystemProbes().leader("127.0.0.1", port) == ("open", "")
    finally:
        listener.close()
    assert SystemProbes().leader("127.0.0.1", port)[0] == "refused"
    assert SystemProbes().leader("no-such-host.invalid", port)[0] == "unreachable"


def test_recipes_show_prints_the_split_and_both_commands(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from carbonforge_runtime.cli.main import app

    result = CliRunner().invoke(app, ["recipes", "show", MULTI_KEY], env={"CF_TINY_MODEL_DIR": str(tmp_path)})
    assert result.exit_code == 0, result.output
    assert "# hosts: 2 hosts x 8 GPUs; data parallel across hosts (tensor 2 x pipeline 1 x data 8 = 16 GPUs)" in \
        result.output
    leader, worker = result.output.split("# vLLM command of ")[1:]
    assert "--node-rank 0 --master-addr LEADER_ADDRESS" in leader and "--headless" not in leader
    assert "--node-rank 1 --master-addr LEADER_ADDRESS" in worker and worker.rstrip().endswith("--headless")
