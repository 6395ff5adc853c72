from __future__ import annotations

import pytest

from dstool.cli import COMMANDS, build_parser
from dstool.config import cli_extra, load_config, overrides
from dstool.errors import UsageError
from dstool.train import TrainConfig, deepspeed_config

from conftest import cli


def test_yaml_then_flags_override(tmp_path):
    (tmp_path / "c.yaml").write_text("zero: 3\nmax-steps: 50\nlr: 0.002\nenv:\n  NCCL_IB_DISABLE: '1'\n")
    ns = build_parser().parse_args(["train", "--config", str(tmp_path / "c.yaml"), "--max-steps", "7",
                                    "--env", "NCCL_SOCKET_IFNAME=eth0"])
    cfg = load_config(TrainConfig, ns.config, overrides(ns, TrainConfig))
    assert (cfg.zero, cfg.max_steps, cfg.lr) == (3, 7, 0.002)
    assert cfg.env == {"NCCL_SOCKET_IFNAME": "eth0"}  # a flag replaces the file's mapping


def test_config_errors_are_one_line():
    with pytest.raises(UsageError) as e:
        load_config(TrainConfig, None, {"zero": 5})
    assert "\n" not in str(e.value) and "zero" in str(e.value)


def test_batch_plan_and_lr_scaling():
    cfg = TrainConfig(micro_batch_size=4, global_batch_size=32, lr=1e-3, max_steps=200)
    assert deepspeed_config.batch_plan(cfg, world=4) == (4, 2)
    assert deepspeed_config.peak_lr(cfg, 4) == pytest.approx(4e-3)
    assert deepspeed_config.warmup_steps(cfg) == 10  # 5 % of 200
    assert deepspeed_config.peak_lr(cfg.model_copy(update={"lr_scaling": "none"}), 4) == pytest.approx(1e-3)
    with pytest.raises(UsageError):
        deepspeed_config.batch_plan(cfg, world=3)


def test_generated_deepspeed_config_and_merge(tmp_path):
    user = tmp_path / "ds.json"
    user.write_text('{"gradient_clipping": 0.5, "zero_optimization": {"reduce_bucket_size": 1000000}}')
    cfg = TrainConfig(zero=3, offload_optimizer=True, offload_params=True, deepspeed_config=str(user))
    ds = deepspeed_config.build(cfg, world=2, precision="bf16", on_gpu=False)
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["zero_optimization"]["reduce_bucket_size"] == 1000000  # merged, siblings kept
    assert ds["gradient_clipping"] == 0.5
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert "torch_adam" not in ds["optimizer"]["params"]  # offload needs DeepSpeedCPUAdam
    assert ds["train_batch_size"] == 8 * 1 * 2


# One YAML file per command: the keys are the config model's fields, positional arguments included.
YAML = {"train": "max_steps: 7\n", "doctor": "nproc: 3\n", "compress": "model: m\noutput: o\nbits: 4\n",
        "plan": "tokens: '5000'\ngpu: H100\n",
        "export": "model: m\nname: lm\n", "serve": "http_port: 9000\ncache: memory\n",
        "gateway": "upstreams: [127.0.0.1:9000]\ncache_ttl: 5\n", "pipeline": "train_steps: 9\nprompts: [hi]\n",
        "infer": "prompt: hello\nprotocol: grpc\n", "keys": "action: create\ntenant: team-a\nrpm: 60\n",
        "batch": "input: p.jsonl\ntask: score\nspark_conf:\n  spark.task.cpus: '2'\n",
        "eval": "model: m\ntasks: [sotu_ppl, convo_mc]\nlimit: 5\n"}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_takes_a_config_file_and_flags_from_its_model(command, tmp_path):
    model = COMMANDS[command].config()
    (tmp_path / "c.yaml").write_text(YAML[command])
    ns = build_parser().parse_args([command, "--config", str(tmp_path / "c.yaml")])
    cfg = load_config(model, ns.config, overrides(ns, model))
    import yaml

    for key, value in yaml.safe_load(YAML[command]).items():
        assert cfg.model_dump(mode="json")[key] == value, key  # typed fields (a cache URL) dump as given
    parser_flags = {a.dest for a in next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices
                                         and command in a.choices).choices[command]._actions}
    visible = {name for name, f in model.model_fields.items() if not cli_extra(f).get("hidden")}
    assert visible <= parser_flags  # every option is a flag (or the positional), generated from the field


def test_a_flag_overrides_the_config_file_and_errors_name_the_key(tmp_path):
    (tmp_path / "c.yaml").write_text("model: m\noutput: o\nbits: 4\nsparsity: banana\n")
    result = cli("compress", "--config", str(tmp_path / "c.yaml"))
    assert result.returncode == 2 and "sparsity must be an N:M pattern" in result.stderr
    result = cli("compress", "--config", str(tmp_path / "c.yaml"), "--sparsity", "2:3", "--bits", "3")
    assert result.returncode == 2 and "bits must be 8 or 4" in result.stderr


def test_a_failure_is_one_line_naming_its_log_and_the_traceback_is_in_the_log(monkeypatch, tmp_path):
    """Exit codes: a defect (any exception) is exit 1 and one line; its traceback goes to the run's log, and to
    the console only with -v. A failed gate or crashed engine (Failed) names its own log."""
    import dataclasses

    from dstool import log
    from dstool.cli import commands as cli_module
    from dstool.errors import EngineFailed

    def defect(cfg):
        log.to_file(tmp_path / "run.log")
        raise RuntimeError("something broke\nsecond line")

    def crash(cfg):
        raise EngineFailed("Triton exited on its own with code 137", log=tmp_path / "triton.log")

    for run, code in ((defect, 1), (crash, 1)):
        monkeypatch.setitem(cli_module.COMMANDS, "infer", dataclasses.replace(cli_module.COMMANDS["infer"], run=run))
        result = cli("infer", "hello")
        assert result.returncode == code and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "infer: Triton exited on its own with code 137 (log: " + str(tmp_path / "triton.log") in result.stderr
    monkeypatch.setitem(cli_module.COMMANDS, "infer", dataclasses.replace(cli_module.COMMANDS["infer"], run=defect))
    result = cli("infer", "hello")
    assert "RuntimeError: something broke (log: " + str(tmp_path / "run.log") in result.stderr
    assert "-v shows the traceback" in result.stderr and "Traceback" not in result.stderr
    assert "Traceback" in (tmp_path / "run.log").read_text()
    assert "Traceback" in cli("infer", "hello", "-v").stderr


def test_a_cache_url_is_parsed_once_and_none_given_means_auto(monkeypatch, tmp_path):
    """--cache is a typed URL in every command's config (the text in YAML and on the flag, the parsed value in the
    model); a cache not given is `auto` everywhere, resolved by one rule: $DSTOOL_REDIS_URL or the local Redis."""
    from dstool.cli.pipeline import PipelineConfig
    from dstool.config import dump_yaml
    from dstool.serve.cache_url import AUTO, DEFAULT_REDIS, CacheURL
    from dstool.serve.config.gateway_config import GatewayConfig
    from dstool.serve.config.serve_config import ServeConfig

    assert GatewayConfig(upstreams=["127.0.0.1:9000"]).cache == AUTO and PipelineConfig().cache == AUTO
    assert ServeConfig().cache is None  # no gateway; `--cache` alone is auto
    ns = build_parser().parse_args(["serve", "--cache"])
    serve = load_config(ServeConfig, None, overrides(ns, ServeConfig))
    assert serve.cache == AUTO and serve.gateway("127.0.0.1:1", "127.0.0.1:2").cache == AUTO
    secret = "redis://:s3cret@10.1.2.3:6380/2"
    gw = load_config(GatewayConfig, None, {"upstreams": ["127.0.0.1:9000"], "cache": secret})
    assert gw.cache.kind == "redis" and str(gw.cache) == secret and "s3cret" not in gw.cache.redacted()
    assert f"cache: {secret}" in dump_yaml(gw)  # the run's config file keeps what was given
    assert load_config(ServeConfig, None, {"cache": "memory"}).gateway("h:1", "h:2").cache.kind == "memory"

    monkeypatch.delenv("DSTOOL_REDIS_URL", raising=False)
    assert AUTO.chosen() == (CacheURL.parse(DEFAULT_REDIS), False)
    monkeypatch.setenv("DSTOOL_REDIS_URL", "unix:///run/redis.sock")
    assert AUTO.chosen() == (CacheURL.parse("unix:///run/redis.sock"), False)
    assert gw.cache.chosen() == (gw.cache, True)
    monkeypatch.setenv("DSTOOL_REDIS_URL", "http://x")
    with pytest.raises(UsageError, match=r"\$DSTOOL_REDIS_URL: 'http://x': unknown scheme"):
        AUTO.chosen()
    for bad, needle in (("bogus://x", "unknown scheme 'bogus'"), ("redis://h:99999", "port"),
                        ("redis://h/x", "database")):
        result = cli("gateway", "--upstream", "127.0.0.1:9000", "--cache", bad)
        assert result.returncode == 2 and needle in result.stderr and len(result.stderr.strip().splitlines()) == 1
    (tmp_path / "c.yaml").write_text("upstreams: [127.0.0.1:9000]\ncache: 5\n")
    with pytest.raises(UsageError, match="cache URL is text"):
        load_config(GatewayConfig, str(tmp_path / "c.yaml"), {})
