"""Training at scale on this CPU: resume on another world size (universal checkpoints), elastic restart
after a rank is SIGKILLed, the preflight doctor and the Kubernetes manifest. Real DeepSpeed processes."""

from __future__ import annotations

import atexit
import json
import shutil
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from dstool.artifacts import Checkpoint, UniversalCheckpoint
from dstool.train import checkpoint, watchdog

from conftest import (
    DSTOOL,
    FAST,
    TRAIN_CODE,
    built_once,
    cli,
    dstool,
    losses,
    model_folder_matches,
    one_line_usage_error,
)

# Same global batch (8) on any world size and no lr scaling: a resumed run can match an uninterrupted one.
SCALE = ["--zero", "2", "--global-batch-size", "8", "--lr-scaling", "none", "--lr", "3e-3", "--max-steps", "8",
         "--save-every", "2", "--keep-checkpoints", "4", "--trace-samples", *FAST]


def _trace(out: Path) -> dict[int, list[int]]:
    """Samples read per step, all ranks together (a resumed run's rows replace the interrupted ones)."""
    per_step: dict[int, dict[tuple, list[int]]] = {}
    for f in sorted(out.glob("samples.rank*.jsonl")):
        rank = int(f.name.split("rank")[1].split(".")[0])
        for line in f.read_text().splitlines():
            r = json.loads(line)
            per_step.setdefault(r["step"], {})[(rank, r["micro"])] = r["samples"]
    return {s: sorted(i for ids in rows.values() for i in ids) for s, rows in per_step.items()}


def _rewind(src: Path, dst: Path, step: int) -> Path:
    """A copy of run `src` as it was when checkpoint `step` was the newest (later tags and trace rows gone)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model", "universal", "heartbeat.json"))
    root = dst / "checkpoints"
    for tag in checkpoint.complete_tags(root):
        if int(tag.split("-")[1]) > step:
            shutil.rmtree(root / tag)
    (root / "latest").write_text(checkpoint.tag_for(step))
    for f in dst.glob("samples.rank*.jsonl"):
        rows = [line for line in f.read_text().splitlines() if json.loads(line)["step"] < step]
        f.write_text("".join(line + "\n" for line in rows))
    return dst


@pytest.fixture(scope="module")
def reference(tmp_path_factory, worker_id):
    """An uninterrupted 2-rank run of SCALE."""
    return built_once(tmp_path_factory, worker_id, "scale_reference",
                      lambda out: dstool("train", "--output", str(out), "--nproc", "2", *SCALE), TRAIN_CODE, SCALE)


@pytest.fixture(scope="module")
def world_changes(reference, tmp_path_factory, worker_id):
    """The reference resumed from its step 4 on 1 rank; that run resumed from its step 6 on 2 ranks (each run with
    its stdout)."""
    def build(out: Path) -> None:
        for name, src, step, nproc in (("2to1", reference, 4, "1"), ("1to2", out / "2to1", 6, "2")):
            run = _rewind(src, out / name, step)
            (out / f"{name}.stdout").write_text(dstool("train", "--output", str(run), "--nproc", nproc, *SCALE).stdout)
    made = built_once(tmp_path_factory, worker_id, "scale_world_changes", build, TRAIN_CODE, (reference, *SCALE))
    return reference, *((made / name, (made / f"{name}.stdout").read_text(), start, saved)
                        for name, start, saved in (("2to1", 4, 2), ("1to2", 6, 1)))


@pytest.mark.parametrize("case", [1, 2], ids=["2to1", "1to2"])
def test_resume_on_another_world_size_continues_the_loss(world_changes, case):
    ref, (out, stdout, start, saved_world) = world_changes[0], world_changes[case]
    assert f"saved on {saved_world} ranks) to a universal checkpoint" in stdout
    assert f"resumed at step {start}" in stdout
    UniversalCheckpoint.read(out / "checkpoints" / "universal" / checkpoint.tag_for(start), verify=True)
    world = 1 if case == 1 else 2
    assert Checkpoint.read(out / "checkpoints" / "step-00000008", verify=True).world_size == world
    a, b = losses(out), losses(ref)
    assert sorted(a) == list(range(1, 9))
    for step in range(start + 1, 9):  # same weights, optimizer moments, lr step and data: only the sum order differs
        assert a[step] == pytest.approx(b[step], abs=2e-4), (step, a, b)
    assert b[8] < b[1] - 0.5  # the curve being compared actually moves


@pytest.mark.parametrize("case", [1, 2], ids=["2to1", "1to2"])
def test_resume_on_another_world_size_keeps_the_data_order(world_changes, case):
    ref, (out, _, _, _) = world_changes[0], world_changes[case]
    a, b = _trace(out), _trace(ref)
    assert a == b  # every step read exactly the uninterrupted run's global batch
    seen = [i for s in sorted(a) for i in a[s]]
    assert len(seen) == len(set(seen)) == 8 * 8  # no sample twice, none skipped


def _ranks(launcher: subprocess.Popen) -> dict[int, psutil.Process]:
    """The training ranks under a `dstool train` process, by global rank (torchrun's agent has no RANK)."""
    procs = psutil.Process(launcher.pid).children(recursive=True)
    return {int(p.environ()["RANK"]): p for p in procs if "RANK" in p.environ()}


@pytest.mark.slow
def test_rank_killed_while_saving_restarts_and_continues(reference, tmp_path):
    """kill -9 rank 0 while checkpoint step 4 is being written: torchrun restarts the ranks, they resume
    from the newest checkpoint that verifies, and the loss curve is the uninterrupted one."""
    out = tmp_path / "restart"
    proc = subprocess.Popen([*DSTOOL, "train", "--output", str(out), "--nproc", "2", "--max-restarts", "1", *SCALE],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    partial = out / "checkpoints" / (checkpoint.PARTIAL + checkpoint.tag_for(4))
    deadline = time.time() + 300
    while not partial.exists():
        assert proc.poll() is None and time.time() < deadline, "run ended before saving step 4"
        time.sleep(0.001)
    _ranks(proc)[0].kill()
    stdout = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, stdout[-3000:]
    restart = next(r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "event" in r)
    assert restart["restart"] == 1 and restart["resumed_from_step"] in (2, 4), restart
    assert 0 <= restart["steps_lost"] <= 2 and 0 < restart["recovery_s"] < 300
    assert "dstool: restart 1: failed after step" in stdout
    root = out / "checkpoints"
    for tag in checkpoint.complete_tags(root):  # whatever the kill interrupted, no damaged tag is in place
        Checkpoint.read(root / tag, verify=True)
    assert not list(root.glob(checkpoint.PARTIAL + "*"))  # the interrupted save was redone
    a, b = losses(out), losses(reference)
    assert sorted(a) == list(range(1, 9)) and all(a[s] == pytest.approx(b[s], abs=1e-5) for s in b), (a, b)


def _doctor(*args: str) -> tuple[int, dict[str, str]]:
    """Exit code and {check name: its line} of `dstool doctor`."""
    proc = dstool("doctor", *args, check=False, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    return proc.returncode, {line.split("] ", 1)[1].split(":", 1)[0]: line for line in lines}


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a machine with NVIDIA GPUs: doctor's GPU checks "
                    "run in scripts/gpu-check.sh there")
def test_doctor_passes_on_this_machine(tmp_path):
    """Every check passes but the GPU topology, a [skip] without NVIDIA GPUs (NVML does not start)."""
    port = _free_port()
    code, checks = _doctor("--output", str(tmp_path / "run"), "--master-port", str(port), "--tensor-parallel", "2",
                           "--expert-parallel", "2")
    assert code == 0, checks
    topology = checks.pop("GPU topology localhost")
    assert all(line.startswith("[pass]") for line in checks.values()), checks
    assert topology.startswith("[skip]") and "no NVIDIA GPU/NVML" in topology, topology
    assert "no GPU visible" in checks["GPUs"] and "passwordless" not in checks["ssh localhost"]
    assert "GB/s" in checks["all-reduce (2 local gloo processes)"]
    assert "2 ranks = PP1 x TP2 x DP1, EP2" in checks["layout"], checks["layout"]


def test_doctor_fails_a_layout_the_world_does_not_factor(tmp_path):
    """--nproc 2 (the world without a hostfile) cannot hold TP3: [FAIL] layout with the reason and the fix, exit 1."""
    code, checks = _doctor("--output", str(tmp_path / "run"), "--master-port", str(_free_port()), "--nproc", "2",
                           "--tensor-parallel", "3")
    failed = {name for name, line in checks.items() if line.startswith("[FAIL]")}
    assert code == 1 and failed == {"layout"}, checks
    assert "--tensor-parallel 3" in checks["layout"] and "multiple of 3" in checks["layout"], checks["layout"]
    assert "fix: change --nproc" in checks["layout"], checks["layout"]


def test_doctor_reports_each_misconfiguration(tmp_path):
    import ipaddress
    import socket

    (tmp_path / "hostfile").write_text("localhost slots=2\nno-such-host.invalid slots=2\n")
    (tmp_path / "a-file").write_text("x")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, checks = _doctor("--hostfile", str(tmp_path / "hostfile"), "--master-port", str(port),
                               "--output", str(tmp_path / "a-file" / "run"), "--env", "NCCL_SOCKET_IFNAME=nosuchif0")
    assert code == 1
    failed = {name for name, line in checks.items() if line.startswith("[FAIL]")}
    # "host names" when this machine's name resolves to a loopback address and the hostfile has another node (gloo
    # on CPU: the NCCL variable does not help)
    loopback = ipaddress.ip_address(socket.gethostbyname(socket.gethostname())).is_loopback
    assert failed == {"ssh no-such-host.invalid", f"master port {port}", "NCCL_SOCKET_IFNAME",
                      f"output {tmp_path / 'a-file' / 'run'}"} | ({"host names"} if loopback else set()), checks
    # the node ssh does not reach gave no versions or address: not checked, never passed
    skipped = {name for name, line in checks.items() if line.startswith("[skip]")}
    assert skipped == {"versions", "GPU topology localhost", "GPU topology no-such-host.invalid"} | (
        set() if loopback else {"host names"}), checks
    assert "no-such-host.invalid: not checked" in checks["versions"]
    assert "does not resolve" in checks["ssh no-such-host.invalid"] and "fix:" in checks["ssh no-such-host.invalid"]
    assert "in use" in checks[f"master port {port}"] and "--master-port" in checks[f"master port {port}"]
    assert "nosuchif0" in checks["NCCL_SOCKET_IFNAME"] and "lo" in checks["NCCL_SOCKET_IFNAME"]
    assert "not writable" in checks[f"output {tmp_path / 'a-file' / 'run'}"]


def test_doctor_usage_error_exits_2(tmp_path):
    one_line_usage_error(cli("doctor", "--hostfile", str(tmp_path / "missing")), "does not exist")


def _answer(address: str | None = "10.0.0.2", versions: str = "3.11.9 2.5.1 0.16.0") -> dict:
    """What the probe prints on a node with interfaces lo and eth0."""
    return {"versions": versions, "hostname": "n", "address": address,
            "interfaces": {"lo": ["127.0.0.1"], "eth0": ["10.0.0.2"]}}


def _marks(*checks) -> list[str]:
    return [c.line().split("]")[0][1:] for c in checks]


def test_doctor_node_checks_pass_only_on_every_nodes_answer():
    """versions, interfaces and host names: [pass] needs every node's answer; a node that gave none leaves the check
    [skip] (naming it), unless what the others answered already fails it; a reached node whose probe failed fails."""
    from dstool.train import doctor

    hosts = ["node0", "node1"]
    env = {"NCCL_SOCKET_IFNAME": "eth0"}

    def node_checks(probes: dict) -> list:
        return [doctor.check_versions(probes, hosts), *doctor.check_interfaces(env, probes, hosts),
                doctor.check_hostnames(probes, hosts, {}, False)]

    nothing = node_checks({})  # no node reached
    assert _marks(*nothing) == ["skip", "skip", "pass", "skip"], [c.line() for c in nothing]
    assert all("no node answered" in c.detail for c in (nothing[0], nothing[1], nothing[3]))
    assert "not set" in nothing[2].detail  # GLOO_SOCKET_IFNAME: nothing to check
    half = node_checks({"node0": _answer()})  # node1 not reached by ssh
    assert _marks(*half) == ["skip", "skip", "pass", "skip"], [c.line() for c in half]
    assert all("node1" in c.detail for c in (half[0], half[1], half[3]))
    failed_probe = node_checks({"node0": _answer(), "node1": "no /opt/venv/bin/python there"})
    assert _marks(*failed_probe) == ["FAIL", "skip", "pass", "skip"], [c.line() for c in failed_probe]
    assert "no /opt/venv/bin/python there" in failed_probe[0].detail and failed_probe[0].fix
    unresolved = doctor.check_hostnames({"node0": _answer(), "node1": _answer(address=None)}, hosts, {}, False)
    assert unresolved.ok is False and "node1: n -> no address" in unresolved.detail, unresolved.line()
    every = node_checks({"node0": _answer(), "node1": _answer()})
    assert _marks(*every) == ["pass"] * 4, [c.line() for c in every]
    differ = node_checks({"node0": _answer(), "node1": _answer(versions="3.11.9 2.5.1 0.0.1")})
    assert _marks(differ[0]) == ["FAIL"]


def test_doctor_checks_it_cannot_make_from_here_skip(tmp_path):
    """The master port of another machine, the output folder from a node ssh does not reach, the GPUs of a hostfile
    this node is not in: [skip] with the reason, and the summary counts them."""
    from dstool.train import doctor

    port = _free_port()
    remote = doctor.check_port("node9.invalid", port)
    assert remote.ok is None and "node9.invalid" in remote.detail and "not checked" in remote.detail, remote.line()
    assert doctor.check_port("127.0.0.1", port).ok is True
    out = doctor.check_output(str(tmp_path / "run"), ["localhost", "node9.invalid"], {"localhost"})
    assert _marks(*out) == ["pass", "skip"] and "no ssh" in out[1].detail, [c.line() for c in out]
    gpus = doctor.check_gpus({"node8.invalid": 8, "node9.invalid": 8})
    assert gpus.ok is None and "not in the hostfile" in gpus.detail, gpus.line()
    assert doctor.check_gpus(None).ok is True
    assert doctor.Check("x", None, "why").line() == "[skip] x: why"
    lines: list[str] = []
    assert doctor.summarize([doctor.Check("a", True, ""), remote], lines.append) == 0
    assert lines == [doctor.Check("a", True, "").line(), remote.line(), "doctor: 1/2 checks pass, 1 skipped"]


def test_doctor_layout_factors_the_world_and_keeps_tensor_parallel_in_a_node():
    """The hostfile's slots are the world; TP groups (consecutive ranks) must not span nodes, EP groups that do are a
    warning."""
    from dstool.train import doctor

    fine = doctor.check_layout({"a": 8, "b": 8}, 2, 4, 8, "the hostfile slots")
    assert fine.line() == "[pass] layout: 16 ranks = PP2 x TP4 x DP2, EP8 (each routed expert on 1 rank(s) per stage)"
    odd = doctor.check_layout({"a": 3, "b": 2}, 1, 2, 1, "the hostfile slots")
    assert odd.ok is False and odd.detail == doctor.Layout(5, 1, 2).problem(), odd.line()
    assert "fix: change the hostfile slots" in odd.line(), odd.line()
    split = doctor.check_layout({"a": 6, "b": 2}, 1, 4, 1, "the hostfile slots")
    assert split.ok is False and "TP4 groups would span nodes (a slots=6, b slots=2)" in split.detail, split.line()
    assert "divides 2" in split.fix
    spread = doctor.check_layout({"a": 4, "b": 4}, 1, 2, 8, "the hostfile slots")
    assert spread.line().startswith("[warn] layout: 8 ranks = PP1 x TP2 x DP4, EP8") and "all-to-all" in spread.detail
    lines: list[str] = []
    assert doctor.summarize([fine, spread], lines.append) == 0 and lines[-1] == "doctor: 1/2 checks pass, 1 warn"


# pynvml's topology calls on a box of {gpus} GPUs with {links} active NVLinks each of 12 (0: PCIe boards, their NVLink
# queries not supported); two GPUs in the same group of {per} share common ancestor {near}, others {far}
FAKE_PYNVML = """
NVML_NVLINK_MAX_LINKS, NVML_FEATURE_ENABLED = 18, 1
class NVMLError(Exception): pass
class NVMLError_NotSupported(NVMLError): pass
class NVMLError_InvalidArgument(NVMLError): pass
def nvmlInit(): pass
def nvmlShutdown(): pass
def nvmlDeviceGetCount(): return {gpus}
def nvmlDeviceGetHandleByIndex(i): return i
def nvmlDeviceGetTopologyCommonAncestor(a, b): return {near} if a // {per} == b // {per} else {far}
def nvmlDeviceGetNvLinkState(handle, link):
    if not {links}: raise NVMLError_NotSupported()
    if link >= 12: raise NVMLError_InvalidArgument()
    return int(link < {links})
"""


def test_doctor_gpu_topology_per_node_with_a_fake_nvml(tmp_path, monkeypatch):
    """Two nodes' probes (the real probe subprocess, a fake pynvml first on its path): an NVLink box (8 GPUs, 12
    links each, two CPU sockets) and a PCIe box (4 GPUs, pairs behind one PCIe switch, then the host bridge)."""
    from dstool.train import doctor

    boxes = {"nvlink": dict(gpus=8, links=12, per=4, near=40, far=50),
             "pcie": dict(gpus=4, links=0, per=2, near=10, far=30)}
    probes: dict[str, dict | str] = {}
    for host, box in boxes.items():
        (tmp_path / host).mkdir()
        (tmp_path / host / "pynvml.py").write_text(FAKE_PYNVML.format(**box))
        monkeypatch.setenv("PYTHONPATH", str(tmp_path / host))
        answer = doctor.probe("localhost")
        assert isinstance(answer, dict), answer
        probes[host] = answer
    assert probes["nvlink"]["topology"]["links"] == [12] * 8 and probes["pcie"]["topology"]["links"] == [0] * 4
    hosts = {"nvlink": 8, "pcie": 4}
    nvlink, pcie = doctor.check_topology(probes, hosts, 4)
    assert nvlink.line() == "[pass] GPU topology nvlink: 8 GPUs, NVLink (12 active links each); TP4 groups on NVLink"
    assert pcie.line().startswith("[warn] GPU topology pcie: 4 GPUs, PCIe only (common ancestor: host bridge); TP4 "
                                  "all-reduces every layer over PCIe -> fix:"), pcie.line()
    pairs = doctor.check_topology(probes, hosts, 2)[1]  # TP2 groups stay behind one PCIe switch
    assert pairs.warn and "PCIe only (common ancestor: one PCIe switch)" in pairs.detail, pairs.line()
    assert [c.line() for c in doctor.check_topology(probes, hosts, 1)] == [
        "[pass] GPU topology nvlink: 8 GPUs, NVLink (12 active links each)",
        "[pass] GPU topology pcie: 4 GPUs, PCIe only (common ancestor: host bridge)"]
    unreached = doctor.check_topology({"a": "no answer within 60 s"}, {"a": 8, "b": 8}, 2)
    assert [c.line() for c in unreached] == ["[skip] GPU topology a: not checked (no answer within 60 s)",
                                             "[skip] GPU topology b: not checked (no ssh)"]


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a machine with NVIDIA GPUs: doctor's topology "
                    "is checked by scripts/gpu-check.sh there")
def test_doctor_gpu_topology_without_a_gpu_is_a_skip():
    """This machine's real NVML (no NVIDIA driver): no GPUs and why, a [skip] that says so."""
    from dstool.train import doctor

    topology = doctor.gpu_topology()
    assert topology["gpus"] == 0 and "NVML" in topology["why"], topology
    check, = doctor.check_topology({"localhost": {"topology": topology}}, {"localhost": 2}, 2)
    assert check.ok is None and check.detail.startswith("no NVIDIA GPU/NVML here"), check.line()


def _free_port() -> int:
    from dstool.proc import free_port

    return free_port()


def test_emit_k8s_is_a_valid_pytorchjob(tmp_path):
    import jsonschema
    import yaml

    schema = json.loads((Path(__file__).parent / "schemas" / "pytorchjob-v1.schema.json").read_text())
    result = cli("train", "--emit", "k8s", "--num-nodes", "3", "--nproc", "8", "--zero", "3", "--output",
                 str(tmp_path / "Big_Run"), "--image", "registry.example/dstool:0.1", "--pvc", "shared-ckpt",
                 "--env", "NCCL_IB_DISABLE=1", "--max-restarts", "2")
    assert result.returncode == 0, result.stderr
    job = yaml.safe_load(result.stdout)
    jsonschema.validate(job, schema)
    assert not (tmp_path / "Big_Run").exists()  # emitted, not run
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 2
    pod = specs["Worker"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == "registry.example/dstool:0.1" and c["resources"]["limits"]["nvidia.com/gpu"] == 8
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["NCCL_IB_DISABLE"] == "1" and env["NCCL_SOCKET_IFNAME"] == "eth0"
    run_cfg = yaml.safe_load(env["DSTOOL_CONFIG"])
    assert run_cfg["num_nodes"] == 3 and run_cfg["nproc"] == 8 and run_cfg["zero"] == 3
    assert run_cfg["output"] == "/checkpoints/Big_Run" and run_cfg["max_restarts"] == 2
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "shared-ckpt"}} in pod["volumes"]
    # preemption: the pod's grace covers dstool's, and the run's exit 143 restarts it
    assert pod["terminationGracePeriodSeconds"] > run_cfg["preempt_grace_s"]
    assert specs["Worker"]["restartPolicy"] == "ExitCode"
    broken = json.loads(json.dumps(job))
    broken["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] = "Sometimes"
    with pytest.raises(jsonschema.ValidationError):  # the schema check can fail
        jsonschema.validate(broken, schema)


@pytest.fixture(scope="module")
def model_parallel(reference, tmp_path_factory, worker_id):
    """SCALE trained on 2 ranks as 2 pipeline stages (DeepSpeed PipelineModule, with its activation checkpointing)
    and as 2 AutoTP ranks: one model replica each, so the global batch of 8 is the reference's. Each with its
    stdout."""
    layouts = {"pipeline": ("--pipeline-stages", "2", "--activation-checkpointing"),
               "tensor": ("--tensor-parallel", "2")}

    def build(out: Path) -> None:
        for name, flags in layouts.items():
            (out / f"{name}.stdout").write_text(dstool("train", "--output", str(out / name), "--nproc", "2", *SCALE,
                                                       "--zero", "1", "--save-every", "8", *flags).stdout)
    made = built_once(tmp_path_factory, worker_id, "scale_model_parallel", build, TRAIN_CODE, (*SCALE, layouts))
    return reference, {name: (made / name, (made / f"{name}.stdout").read_text()) for name in layouts}


@pytest.mark.parametrize("kind", ["pipeline", "tensor"])
def test_model_parallel_training_matches_data_parallel(model_parallel, kind):
    ref, (out, stdout) = model_parallel[0], model_parallel[1][kind]
    assert "x DP1" in stdout  # the layout line: one model replica
    assert "stage=" not in stdout and "[INFO]" not in stdout  # DeepSpeed's prints: in the ranks' logs
    if kind == "pipeline":  # DeepSpeed's activation checkpointing: each stage recomputes its 2 decoder layers
        assert "2 decoder layers of this stage recomputed" in (out / "logs" / "rank1.log").read_text()
    a, b = losses(out), losses(ref)
    assert sorted(a) == list(range(1, 9))
    for step in a:  # same weights, batch and lr: only the order of the float sums differs
        assert a[step] == pytest.approx(b[step], abs=1e-4), (step, a, b)
    assert a[8] < a[1] - 0.5
    global_batches = _trace(ref)
    for f in out.glob("samples.rank*.jsonl"):  # every stage / tensor-parallel peer read the whole global batch
        rows: dict[int, list[int]] = {}
        for r in map(json.loads, f.read_text().splitlines()):
            rows.setdefault(r["step"], []).extend(r["samples"])
        assert {s: sorted(ids) for s, ids in rows.items()} == global_batches, f.name
    ds = json.loads((out / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 1 and ds["train_micro_batch_size_per_gpu"] * \
        ds["gradient_accumulation_steps"] == 8
    assert ds.get("tensor_parallel") == ({"autotp_size": 2} if kind == "tensor" else None)
    tag = out / "checkpoints" / "step-00000008"
    assert Checkpoint.read(tag, verify=True).world_size == 2
    names = {p.name for p in tag.iterdir()}
    if kind == "pipeline":  # DeepSpeed's pipeline layout: one file per pipeline layer (embedding, 4 decoders, head)
        assert {f"layer_{i:02d}-model_states.pt" for i in range(6)} <= names, names
    else:  # one model-states file per tensor-parallel rank
        assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"} <= names, names


@pytest.mark.parametrize("kind", ["pipeline", "tensor"])
def test_model_parallel_model_folder_reloads(model_parallel, kind):
    """The stages / tensor shards gathered into model/ are the whole trained LlamaForCausalLM, the data-parallel
    run's weights."""
    model_folder_matches(model_parallel[1][kind][0], reference=model_parallel[0])


@pytest.mark.parametrize("args,needle", [
    (["--pipeline-stages", "2", "--zero", "1", "--nproc", "3"], "world size 3 is not divisible by --pipeline-stages 2"),
])  # the architectures pipelines refuse: tests/test_train_3d.py
def test_model_parallel_bad_input(args, needle, tmp_path):
    one_line_usage_error(cli("train", "--output", str(tmp_path / "run"), *args), needle)
    assert not (tmp_path / "run").exists()


def test_model_parallel_bad_config():
    from dstool.config import load_config
    from dstool.errors import UsageError
    from dstool.train import TrainConfig, deepspeed_config

    for flags, needle in [({"pipeline_stages": 2}, "needs zero 0 or 1"),
                          ({"pipeline_stages": 2, "tensor_parallel": 2, "expert_parallel": 2, "zero": 1},
                           "cannot be combined"),
                          ({"tensor_parallel": 2, "distill_from": "teacher"}, "data parallelism only")]:
        with pytest.raises(UsageError, match=needle):
            load_config(TrainConfig, None, flags)
    with pytest.raises(UsageError, match="world size 6 is not divisible by --tensor-parallel 4"):
        deepspeed_config.build(TrainConfig(tensor_parallel=4), world=6, precision="fp32", on_gpu=False)


def test_a_node_that_joined_but_never_beat_is_named_after_the_timeout(tmp_path, monkeypatch):
    """Node 1 joined the process group, then went silent before its heartbeat thread ever reached the store (a fast
    run cut right after its first checkpoint): node 0 names its host within --comm-timeout-s, not after the
    start-up grace for a node that never came."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}.items():
        monkeypatch.setenv(name, value)  # LOCAL_RANK 1: no heartbeat thread, the rounds are called here
    watch = watchdog.Watch(tmp_path, 0.3, "test", elastic=False)
    atexit.unregister(watch._at_exit)
    watch.joined(["host-a", "host-b"])
    seen: dict = {}
    assert watch._beat(True, time.monotonic(), seen) == ()
    time.sleep(0.5)
    message, post = watch._beat(False, time.monotonic(), seen)
    assert message.startswith("host host-b (node 1, rank(s) 1-1) went silent: no heartbeat for 0.3 s") and post
