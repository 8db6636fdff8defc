"""Config files load with the documented values; bad files fail with file, key, value and expectation."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from switchyard.common.config import ConfigError, SwitchyardConfig, load_config
from switchyard.common.config.loader import FORMER_NAMES

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def config_dir(tmp_path):
    target = tmp_path / "config"
    shutil.copytree(ROOT / "config", target)
    return target


def test_shipped_config_has_design_values():
    cfg = load_config(ROOT / "config")
    q = cfg.queues
    assert (q.orchestration.capacity, q.orchestration.workers, q.orchestration.timeout_ms) == (2048, 16, 3000)
    assert (q.retrieval.capacity, q.retrieval.workers, q.retrieval.timeout_ms) == (1024, 8, 2000)
    assert (q.inference.capacity, q.inference.max_batches_in_prefill, q.inference.timeout_ms) == (512, 4, 30000)
    assert cfg.batching.max_batch_size == 32 and cfg.batching.flush_interval_ms == 20
    assert cfg.upstream.default_model == "claude-sonnet-4-5"
    assert cfg.upstream.fallback_model == "gpt-4o-mini"
    s = cfg.scheduler
    assert s.time_slice_ms == 20 and s.max_admitted_per_decision == 10
    assert (s.compute_score_weights.cuda_util, s.compute_score_weights.tensor_util) == (0.2, 0.6)
    assert s.admission_score_limit == 80
    assert (s.priority_boost.core, s.priority_boost.normal, s.priority_boost.batch) == (10, 5, 1)
    assert s.preemption_enabled and s.core_wait_before_preempt_ms == 0
    m = cfg.memory
    assert m.hbm.capacity_ratio == 0.85 and m.hbm.emergency_evict_ratio == 0.9
    assert m.dram.port == 6379
    assert m.oss.archive_after_s == 3600 and m.scan.hbm_scan_interval_s == 300


def test_bad_value_names_file_key_value_and_expectation(config_dir):
    path = config_dir / "queue.json"
    data = json.loads(path.read_text())
    data["queues"]["orchestration"]["capacity"] = -5
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as err:
        load_config(config_dir)
    msg = str(err.value)
    assert "queue.json" in msg
    assert "queues.orchestration.capacity" in msg
    assert "-5" in msg
    assert "greater than or equal to 1" in msg


def test_unknown_key_is_reported_as_typo(config_dir):
    path = config_dir / "scheduler_config.json"
    data = json.loads(path.read_text())
    data["time_slise_ms"] = 20
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"scheduler_config.json: key 'time_slise_ms'.*no such key \(a typo\?\); "
                       r"did you mean 'time_slice_ms'\?"):
        load_config(config_dir)
    config = load_config(ROOT / "config")
    with pytest.raises(ConfigError, match=r"'batching.flush_intervl_ms'.*did you mean 'flush_interval_ms'\?"):
        config.with_overrides(**{"batching.flush_intervl_ms": 20})
    with pytest.raises(ConfigError, match=r"'scheduler.compute_score_weights.cuda_utl'.*did you mean 'cuda_util'\?"):
        config.with_overrides(**{"scheduler.compute_score_weights.cuda_utl": 0.2})
    with pytest.raises(ConfigError) as far:  # nothing near: no guess
        config.with_overrides(**{"batching.zzzz": 1})
    assert "did you mean" not in str(far.value)


def test_a_missing_config_folder_names_where_it_looked_and_how_to_name_another(tmp_path):
    with pytest.raises(ConfigError, match=r"config folder not found.*--config-dir or SWITCHYARD_CONFIG_DIR") as missing:
        load_config(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(missing.value)


def test_cross_field_check_quotes_values(config_dir):
    path = config_dir / "memory_policy.toml"
    text = path.read_text()
    assert "demote_threshold" in text
    text = "\n".join("demote_threshold = 2.0e6" if line.startswith("demote_threshold") else line
                     for line in text.splitlines())
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"demote_threshold \(2000000.0\) must be below renew_ttl_threshold \(1000000.0\)"):
        load_config(config_dir)


@pytest.mark.parametrize(("change", "says"), [
    ({"default_task_type": "rag"},  # loaded; every task naming no task type was then refused INVALID_ARGUMENT
     "key 'orchestrator.default_task_type' has value 'rag'; expected: one of rag_answer, chat, react_loop"),
    ({"react": {"tool_backoff_initial_ms": 5000}},  # loaded; every retry waited the 1000 ms of the max, unsaid
     "section 'orchestrator.react': tool_backoff_max_ms (1000) must not be below tool_backoff_initial_ms (5000)"),
])
def test_an_orchestrator_value_it_could_not_use_is_refused_at_load(config_dir, change, says):
    path = config_dir / "switchyard.json"
    data = json.loads(path.read_text())
    data["orchestrator"].update(change)
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as err:
        load_config(config_dir)
    assert says in str(err.value), str(err.value)


def test_former_key_name_loads_with_a_warning_naming_the_new_one(config_dir, caplog):
    path = config_dir / "scheduler_config.json"
    data = json.loads(path.read_text())
    data["max_running_agents"] = data.pop("max_admitted_per_decision") + 3
    path.write_text(json.dumps(data))
    with caplog.at_level("WARNING"):
        cfg = load_config(config_dir)
    assert cfg.scheduler.max_admitted_per_decision == 13
    assert "'max_running_agents' is the former name of 'max_admitted_per_decision'" in caplog.text


def test_former_and_current_key_together_is_an_error(config_dir):
    path = config_dir / "scheduler_config.json"
    data = json.loads(path.read_text())
    data["max_running_agents"] = 10
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"former name of 'max_admitted_per_decision': give one of them, not both"):
        load_config(config_dir)


def test_removed_key_loads_with_a_warning_and_is_ignored(config_dir, caplog):
    path = config_dir / "scheduler_config.json"
    data = json.loads(path.read_text())
    data["low_load_threshold"] = 30
    path.write_text(json.dumps(data))
    with caplog.at_level("WARNING"):
        load_config(config_dir)
    assert "'low_load_threshold' is no longer a setting: nothing reads it" in caplog.text


def test_bad_toml_names_file(config_dir):
    (config_dir / "memory_policy.toml").write_text("[hbm\ncapacity_ratio = ")
    with pytest.raises(ConfigError, match=r"memory_policy.toml: not valid TOML"):
        load_config(config_dir)


def test_a_file_saved_with_a_utf8_byte_order_mark_loads_as_without_it(config_dir):
    """Some editors save UTF-8 with a leading BOM (RFC 8259 lets a parser ignore it): every file of the config
    with one loads the same config; each was refused 'not valid JSON: Unexpected UTF-8 BOM (decode using
    utf-8-sig)' or 'not valid TOML: Invalid statement'."""
    plain = load_config(config_dir)
    for path in config_dir.iterdir():
        path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert load_config(config_dir) == plain


def test_weights_must_sum_to_one(config_dir):
    path = config_dir / "scheduler_config.json"
    data = json.loads(path.read_text())
    data["compute_score_weights"]["tensor_util"] = 0.9
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"compute_score_weights.*sum to 1.0"):
        load_config(config_dir)


def test_engine_env_overrides_config(monkeypatch):
    monkeypatch.setenv("SWITCHYARD_ENGINE", "openai")
    assert load_config(ROOT / "config").dispatcher.engine == "openai"
    monkeypatch.setenv("SWITCHYARD_ENGINE", "tpu")
    with pytest.raises(ValueError, match="SWITCHYARD_ENGINE='tpu'.*expected one of"):
        load_config(ROOT / "config")


@pytest.mark.parametrize("command", [("up", "--free-ports"), ("serve", "retrieval")], ids=" ".join)
def test_an_unknown_log_level_is_refused_before_anything_starts_naming_the_variable(command):
    """SWITCHYARD_LOG_LEVEL=LOUD crashed every service with a traceback (ValueError: Unknown level: 'LOUD')."""
    run = subprocess.run([sys.executable, "-m", "switchyard.cli", *command], capture_output=True, text=True,
                         timeout=60, cwd=ROOT, env={**os.environ, "SWITCHYARD_LOG_LEVEL": "LOUD"})
    assert run.returncode == 2, run.stdout + run.stderr
    assert "environment variable SWITCHYARD_LOG_LEVEL='LOUD': expected one of 'DEBUG', 'INFO', 'WARNING', " \
        "'ERROR', 'CRITICAL'" in run.stderr
    assert "Traceback" not in run.stderr and "ready on" not in run.stderr


def test_the_log_level_is_read_in_any_case(monkeypatch):
    from switchyard.common import envs

    monkeypatch.setenv("SWITCHYARD_LOG_LEVEL", " debug")
    assert envs.SWITCHYARD_LOG_LEVEL.get() == "DEBUG"
    monkeypatch.setenv("SWITCHYARD_LOG_LEVEL", "warn")
    assert envs.SWITCHYARD_LOG_LEVEL.get() == "WARN"


def test_missing_file_is_an_error_naming_it(config_dir):
    (config_dir / "switchyard.json").unlink()
    with pytest.raises(ConfigError, match=r"switchyard.json: file not found"):
        load_config(config_dir)


def test_every_bad_file_is_reported_at_once(config_dir):
    (config_dir / "memory_policy.toml").write_text("[hbm\n")
    path = config_dir / "switchyard.json"
    data = json.loads(path.read_text())
    data["orchestrator"]["port"] = 70000
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as err:
        load_config(config_dir)
    assert "memory_policy.toml: not valid TOML" in str(err.value)
    assert "switchyard.json: key 'orchestrator.port' has value 70000" in str(err.value)


def test_a_string_is_not_taken_for_a_number(config_dir):
    path = config_dir / "queue.json"
    data = json.loads(path.read_text())
    data["queues"]["retrieval"]["workers"] = "8"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"queues.retrieval.workers' has value '8'; expected: Input should be a valid integer"):
        load_config(config_dir)


def _numeric_keys(model, prefix):
    """Every dotted key under ``model`` whose value may be a number (int or float, alone or in a union)."""
    import typing

    for name, field in model.model_fields.items():
        args = typing.get_args(field.annotation) or (field.annotation,)
        nested = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if nested and len(args) == 1:
            yield from _numeric_keys(nested[0], f"{prefix}.{name}")
        elif any(a in (int, float) for a in args):
            yield f"{prefix}.{name}"


def test_no_numeric_key_takes_a_string_or_a_boolean_for_a_number():
    """batching.flush_interval_ms (a number or "auto") took "20" for 20 and true for 1 ms, against the rule every
    other key keeps; every key that takes a number is checked here."""
    from switchyard.common.config.sections import SECTIONS

    config = load_config(ROOT / "config")
    keys = [key for name, section in SECTIONS.items() for key in _numeric_keys(section.model, name)]
    assert "batching.flush_interval_ms" in keys and len(keys) > 100, keys
    accepted = []
    for key in keys:
        for wrong in ("20", True):
            try:
                config.with_overrides(**{key: wrong})
            except ConfigError:
                continue
            accepted.append((key, wrong))
    assert accepted == []
    assert config.with_overrides(**{"batching.flush_interval_ms": "auto"}).batching.adaptive
    assert config.with_overrides(**{"batching.flush_interval_ms": 5}).batching.flush_interval_ms == 5.0
    with pytest.raises(ConfigError, match=r"flush_interval_ms.*expected: milliseconds, a number in \(0, 10000\], or \"auto\""):
        config.with_overrides(**{"batching.flush_interval_ms": "20"})


# --------------------------------------------------------------------------- one class per concern


def _models(model, seen=None):
    """``model`` and every config class reachable from its fields."""
    from pydantic import BaseModel

    seen = seen if seen is not None else {}
    seen[model.__name__] = model
    for field in model.model_fields.values():
        args = [field.annotation, *getattr(field.annotation, "__args__", ())]
        for arg in args:
            if isinstance(arg, type) and issubclass(arg, BaseModel) and arg.__name__ not in seen:
                _models(arg, seen)
    return seen


def test_every_field_has_a_description_and_a_duration_unit_suffix_of_ms_or_s():
    from switchyard.common.config import SwitchyardConfig

    models = _models(SwitchyardConfig)
    assert not [name for name in models if name.endswith("File")], "classes are named after concerns, not files"
    undocumented, sec = [], []
    for name, model in models.items():
        for field_name, field in model.model_fields.items():
            if not (field.description or "").strip():
                undocumented.append(f"{name}.{field_name}")
            if field_name.endswith(("_sec", "_secs", "_seconds", "_millis")):
                sec.append(f"{name}.{field_name}")
    assert not undocumented, f"fields without a description: {undocumented}"
    assert not sec, f"durations end in _ms or _s: {sec}"


def _write(config_dir, filename, edit):
    path = config_dir / filename
    if path.suffix == ".toml":
        path.write_text(edit(path.read_text()))
        return
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _break_every_section_but(config_dir, service):
    """Put a bad value in every section ``service`` does not read."""
    from switchyard.common.config import SECTIONS, sections_read_by

    read = set(sections_read_by(service, "sim" if service == "dispatcher" else None))
    for name, section in SECTIONS.items():
        if name in read:
            continue
        path = config_dir / section.file
        if path.suffix == ".toml":
            text = path.read_text()
            table = section.keys[0]
            path.write_text(text.replace(f"[{table}]\n", f"[{table}]\nbogus_key = 1\n", 1))
            continue
        data = json.loads(path.read_text())
        node = data
        for key in section.keys:
            node = node.setdefault(key, {})
        node["bogus_key"] = 1
        path.write_text(json.dumps(data))
    return read


@pytest.mark.parametrize("service", ["orchestrator", "retrieval", "dispatcher"])
def test_a_service_validates_only_the_sections_it_reads(config_dir, service):
    read = _break_every_section_but(config_dir, service)
    cfg = load_config(config_dir, service=service)  # the bad sections are not its own
    assert cfg.server.host == "127.0.0.1"
    with pytest.raises(ConfigError, match="bogus_key"):
        load_config(config_dir)  # every section: tools and doctor see them all
    others = {"orchestrator", "retrieval", "dispatcher"} - {service}
    for other in others:
        with pytest.raises(ConfigError, match="bogus_key.*no such key"):
            load_config(config_dir, service=other)
    assert "server" in read


def test_a_section_the_service_does_not_read_is_an_error_to_use(config_dir):
    cfg = load_config(config_dir, service="orchestrator")
    with pytest.raises(ConfigError, match=r"dispatcher \(switchyard.json dispatcher\) is not among the sections "
                                          r"the orchestrator reads"):
        _ = cfg.dispatcher.engine
    with pytest.raises(ConfigError, match=r"queues.retrieval \(queue.json queues.retrieval\)"):
        _ = cfg.queues.retrieval.timeout_ms
    assert cfg.queues.orchestration.workers == 16
    with pytest.raises(ConfigError, match=r"memory.hbm \(memory_policy.toml hbm\) is not among"):
        cfg.memory.hbm.model_dump()  # methods and properties too, not only fields
    with pytest.raises(ConfigError, match="upstream"):
        _ = cfg.upstream.endpoint_urls
    assert "not read by the orchestrator" in repr(cfg.dispatcher)
    with pytest.raises(ConfigError, match="scheduler is not among the sections the orchestrator reads"):
        cfg.with_overrides(**{"scheduler.policy": "fifo"})
    assert cfg.with_overrides(**{"orchestrator.retrieval_timeout_ms": 500}).orchestrator.retrieval_timeout_ms == 500


def test_the_dispatcher_reads_only_its_engines_section(config_dir, monkeypatch):
    _write(config_dir, "switchyard.json", lambda d: d["torch"].update(n_layers=0))
    assert load_config(config_dir, service="dispatcher").sim.model == "sim-7b"  # sim: torch is not read
    monkeypatch.setenv("SWITCHYARD_ENGINE", "torch")
    with pytest.raises(ConfigError, match=r"switchyard.json: key 'torch.n_layers' has value 0"):
        load_config(config_dir, service="dispatcher")


def test_a_bad_shared_section_stops_every_service_that_reads_it(config_dir):
    _write(config_dir, "switchyard.json", lambda d: d["server"].update(shutdown_grace_s=-1))
    for service in ("orchestrator", "retrieval", "dispatcher"):
        with pytest.raises(ConfigError, match=r"switchyard.json: key 'server.shutdown_grace_s' has value -1"):
            load_config(config_dir, service=service)


def test_a_table_name_typo_is_reported_to_every_reader_of_the_file(config_dir):
    _write(config_dir, "queue.json", lambda d: d.update(flsh={}))
    with pytest.raises(ConfigError, match=r"queue.json: key 'flsh'.*no such key"):
        load_config(config_dir, service="retrieval")


def test_default_max_tokens_is_checked_against_limits_max_tokens(config_dir):
    _write(config_dir, "switchyard.json", lambda d: d["limits"].update(default_max_tokens=9000))
    for service in ("dispatcher", "orchestrator"):
        with pytest.raises(ConfigError, match=r"limits.*default_max_tokens \(9000\) must be at most max_tokens \(8192\)"):
            load_config(config_dir, service=service)


@pytest.mark.parametrize("section", ["orchestrator", "dispatcher"])
def test_a_default_max_tokens_in_its_former_section_is_refused_naming_where_it_moved(config_dir, section):
    """One default for a task's and a Generate's model calls (they were 128 and 256): the old key's value is
    not ignored quietly."""
    _write(config_dir, "switchyard.json", lambda d: d[section].update(default_max_tokens=512))
    with pytest.raises(ConfigError, match=rf"key '{section}.default_max_tokens' moved to 'limits.default_max_tokens'"):
        load_config(config_dir)


def test_a_task_and_a_generate_without_max_tokens_get_the_one_default():
    from switchyard.api import agent_pb2
    from switchyard.dispatcher.processor import to_request
    from switchyard.orchestrator.validation import validate

    config = load_config("config").with_overrides(**{"limits.default_max_tokens": 77})
    generate = to_request(agent_pb2.GenerateRequest(request_id="r", prompt="hi"), config, "sim-7b", only_model=True)
    task = validate(agent_pb2.RunTaskRequest(payload="hi"), config, default_model="sim-7b")
    assert generate.max_tokens == task.max_tokens == 77


def test_a_default_max_tokens_past_a_models_window_takes_half_the_window():
    """5000 against sim-7b's 4096 tokens refused every call naming none ("a prompt of at most -904 tokens"),
    and a task's max_tokens range excluded its own default."""
    from switchyard.api import agent_pb2
    from switchyard.dispatcher.processor import to_request
    import asyncio

    from switchyard.orchestrator.validation import validate
    from switchyard.orchestrator.workflows import check_question_fits

    config = load_config("config").with_overrides(**{"limits.default_max_tokens": 5000})
    task = validate(agent_pb2.RunTaskRequest(payload="hi"), config, default_model="sim-7b")
    assert task.max_tokens == 2048  # half of sim-7b's 4096
    asked = agent_pb2.RunTaskRequest(payload="hi", max_tokens=5000)  # the range is checked beside the prompt
    window = config.limits.context_window("sim-7b")
    with pytest.raises(Exception, match=r"max_tokens: expected 0 \(the default, 2048\) to 40\d\d: the lesser"):
        asyncio.run(check_question_fits(validate(asked, config, default_model="sim-7b"), "sim-7b", window,
                                        config.limits, asked.max_tokens))
    short = to_request(agent_pb2.GenerateRequest(request_id="r", prompt="hi", prompt_tokens=10), config, "sim-7b",
                       only_model=True)
    assert short.max_tokens == 2048  # half the window
    with pytest.raises(Exception, match=r"at most 1096 \(0 asks for the default, 2048"):  # named, not sent past it
        to_request(agent_pb2.GenerateRequest(request_id="r", prompt="hi " * 1000, prompt_tokens=3000), config,
                   "sim-7b", only_model=True)


def test_a_connection_age_grace_shorter_than_the_longest_task_is_refused_naming_both_keys(config_dir):
    _write(config_dir, "switchyard.json", lambda d: d["server"].update(max_connection_age_grace_s=5))
    with pytest.raises(ConfigError, match=r"key 'server.max_connection_age_grace_s' has value 5; expected: at least "
                                          r"the longest orchestrator.task_time_limit_s \(react_loop: 600 s\)"):
        load_config(config_dir, service="orchestrator")
    with pytest.raises(ConfigError, match="max_connection_age_grace_s"):
        SwitchyardConfig().with_overrides(**{"orchestrator.task_time_limit_s": {
            "chat": 120, "rag_answer": 180, "react_loop": 900}})
    _write(config_dir, "switchyard.json", lambda d: d["server"].update(max_connection_age_grace_s=600))
    assert load_config(config_dir).server.max_connection_age_grace_s == 600
    assert SwitchyardConfig().server.max_connection_age_grace_s >= max(
        SwitchyardConfig().orchestrator.task_time_limit_s.values())


def test_configs_from_before_layer_preemption_load_with_it_on(config_dir):
    _write(config_dir, "scheduler_config.json", lambda d: d.pop("core_preemption"))
    _write(config_dir, "switchyard.json", lambda d: d["sim"].pop("layers"))
    cfg = load_config(config_dir)
    assert cfg.scheduler.core_preemption == "layer" and cfg.sim.layers == 32
    _write(config_dir, "scheduler_config.json", lambda d: d.update(core_preemption="kernel"))
    with pytest.raises(ConfigError, match="core_preemption"):
        load_config(config_dir)


def test_former_sec_keys_load_with_the_same_meaning_and_a_warning(config_dir, caplog):
    old = (config_dir / "memory_policy.toml").read_text().replace("kv_ttl_s =", "kv_ttl_sec =").replace(
        "ttl_s = 3600", "ttl_sec = 1800")
    (config_dir / "memory_policy.toml").write_text(old)
    _write(config_dir, "switchyard.json", lambda d: d["orchestrator"]["task_store"].update(
        lease_sec=d["orchestrator"]["task_store"].pop("lease_s")))
    with caplog.at_level("WARNING", logger="switchyard.common.config"):
        cfg = load_config(config_dir)
    assert cfg.memory.dram.kv_ttl_s == 7200 and cfg.memory.agent_memory.ttl_s == 1800
    assert cfg.orchestrator.task_store.lease_s == 10
    text = caplog.text
    assert "memory_policy.toml: key 'dram.kv_ttl_sec' is the former name of 'kv_ttl_s'" in text
    assert "switchyard.json: key 'orchestrator.task_store.lease_sec' is the former name of 'lease_s'" in text


def test_a_renamed_key_loads_under_its_former_name_with_a_warning_naming_the_new_one(config_dir, caplog):
    _write(config_dir, "scheduler_config.json", lambda d: d.update(
        preemption_grace_ms=d.pop("core_wait_before_preempt_ms") + 50))
    with caplog.at_level("WARNING", logger="switchyard.common.config"):
        cfg = load_config(config_dir, service="dispatcher")
    assert cfg.scheduler.core_wait_before_preempt_ms == 50
    assert ("scheduler_config.json: key 'preemption_grace_ms' is the former name of 'core_wait_before_preempt_ms'"
            in caplog.text)
    _write(config_dir, "scheduler_config.json", lambda d: d.update(core_wait_before_preempt_ms=0))
    with pytest.raises(ConfigError, match=r"key 'preemption_grace_ms' is the former name of "
                                          r"'core_wait_before_preempt_ms': give one of them, not both"):
        load_config(config_dir, service="dispatcher")


def test_former_and_new_key_together_is_an_error(config_dir):
    _write(config_dir, "switchyard.json", lambda d: d["orchestrator"]["task_store"].update(lease_sec=5))
    with pytest.raises(ConfigError, match=r"key 'orchestrator.task_store.lease_sec' is the former name of "
                                          r"'lease_s': give one of them, not both"):
        load_config(config_dir, service="orchestrator")


def test_a_host_or_model_variable_is_read_without_its_surrounding_spaces(monkeypatch):
    """A ConfigMap key made from a file ends in its newline: the model went upstream as 'qwen\\n' (every call
    NOT_FOUND) and the host ' 0.0.0.0' did not resolve, while every other variable's value was stripped."""
    monkeypatch.setenv("SWITCHYARD_HOST", " 0.0.0.0\n")
    monkeypatch.setenv("SWITCHYARD_ENGINE", "openai")
    monkeypatch.setenv("SWITCHYARD_UPSTREAM_MODEL", "qwen2.5-7b-instruct\n")
    monkeypatch.setenv("SWITCHYARD_TLS_SERVER_NAME", "dispatcher ")
    cfg = load_config(ROOT / "config", service="dispatcher")
    assert cfg.server.host == "0.0.0.0" and cfg.upstream.default_model == "qwen2.5-7b-instruct"
    assert cfg.server.tls.server_name == "dispatcher"


def test_container_variables_override_host_and_task_store(monkeypatch):
    monkeypatch.setenv("SWITCHYARD_HOST", "0.0.0.0")
    monkeypatch.setenv("SWITCHYARD_TASK_STORE", "redis")
    cfg = load_config(ROOT / "config", service="orchestrator")
    assert cfg.server.host == "0.0.0.0" and cfg.orchestrator.task_store.backend == "redis"
    monkeypatch.setenv("SWITCHYARD_TASK_STORE", "postgres")
    with pytest.raises(ValueError, match="SWITCHYARD_TASK_STORE='postgres'.*expected one of 'sqlite', 'redis'"):
        load_config(ROOT / "config", service="orchestrator")


@pytest.mark.parametrize(("target", "problem"), [
    ("host:99999", "port '99999' is not 1-65535"), ("retrieval", "'retrieval' has no port"),
    ("127.0.0.1:", "no port"), (":50052", "':50052' has no host"), ("dns:///retrieval", "'retrieval' has no port"),
    ("ipv4:127.0.0.1:5001,,127.0.0.1:5002", "lists an empty address"), ("a b:50052", "host 'a b' holds a space"),
    ("[::1]", "has no port after its bracketed host"), ("127.0.0.1:0", "port '0' is not 1-65535"),
    # a URL's scheme: http://dispatcher:50053 loaded (host 'http://dispatcher') and gRPC read it as a DNS name;
    # xds:///svc read "port '///svc' is not 1-65535"
    ("http://dispatcher:50053", "scheme 'http:' is not one the orchestrator dials"),
    ("xds:///dispatcher", "scheme 'xds:' is not one the orchestrator dials"),
])
def test_a_downstream_target_no_channel_can_reach_is_refused_at_load_naming_its_key_or_variable(
        config_dir, monkeypatch, target, problem):
    """They loaded: the orchestrator reported ready and every task failed UNAVAILABLE naming the target."""
    _write(config_dir, "switchyard.json", lambda d: d["orchestrator"].update(dispatcher_addr=target))
    with pytest.raises(ConfigError) as refused:
        load_config(config_dir, service="orchestrator")
    message = str(refused.value)
    assert f"key 'orchestrator.dispatcher_addr' has value {target!r}" in message, message
    assert "a port in 1-65535" in message and problem in message, message
    for variable in ("SWITCHYARD_RETRIEVAL_ADDR", "SWITCHYARD_DISPATCHER_ADDR"):
        with monkeypatch.context() as env:
            env.setenv(variable, target)
            with pytest.raises(ValueError, match=re.escape(f"{variable}={target!r}: expected a gRPC target")):
                load_config(ROOT / "config", service="orchestrator")


def test_every_form_of_downstream_target_the_services_use_loads(monkeypatch):
    for target in ("127.0.0.1:50053", "localhost:50053", "[::1]:50053", "ipv4:127.0.0.1:5001,127.0.0.1:5002",
                   "ipv6:[::1]:5001,[::1]:5002", "dns:///dispatcher:50053", "dns://10.0.0.10/dispatcher:50053",
                   "unix:/run/dispatcher.sock", " dispatcher:50053 "):
        monkeypatch.setenv("SWITCHYARD_DISPATCHER_ADDR", target)
        assert load_config(ROOT / "config", service="orchestrator").orchestrator.dispatcher_addr == target.strip()


def test_tls_auth_and_health_port_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("SWITCHYARD_TLS_DIR", "/etc/switchyard-tls/")
    monkeypatch.setenv("SWITCHYARD_TLS_CLIENT_AUTH", "true")
    monkeypatch.setenv("SWITCHYARD_AUTH_TOKENS_FILE", "/etc/switchyard-auth/tokens")
    monkeypatch.setenv("SWITCHYARD_HEALTH_PORT", "50061")
    config = load_config(ROOT / "config", service="orchestrator")
    tls = config.server.tls
    assert (tls.enabled, tls.require_client_auth) == (True, True)
    assert (tls.cert_file, tls.key_file, tls.ca_file) == (
        "/etc/switchyard-tls/tls.crt", "/etc/switchyard-tls/tls.key", "/etc/switchyard-tls/ca.crt")
    assert config.orchestrator.auth.enabled and config.orchestrator.auth.tokens_file == "/etc/switchyard-auth/tokens"
    assert config.orchestrator.health_port == 50061


@pytest.mark.parametrize(("variable", "value", "expected"), [
    ("SWITCHYARD_TLS_CLIENT_AUTH", "yes", "expected true or false"),
    ("SWITCHYARD_HEALTH_PORT", "70000", "expected a TCP port"),
])
def test_a_malformed_tls_or_health_variable_names_itself(monkeypatch, variable, value, expected):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=f"{variable}={value!r}: {expected}"):
        load_config(ROOT / "config", service="dispatcher")


@pytest.mark.parametrize(("variables", "service", "message"), [
    ({"SWITCHYARD_ENGINE": "openai", "SWITCHYARD_UPSTREAM_BASE_URL": "http://x:99999/v1"}, "dispatcher",
     "environment variable SWITCHYARD_UPSTREAM_BASE_URL='http://x:99999/v1': key 'upstream.base_url' has value "
     "'http://x:99999/v1'; expected: an http:// or https:// URL with a host, a port in 1-65535 and no credentials"),
    ({"SWITCHYARD_HEALTH_PORT": "50053"}, "dispatcher",  # dispatcher.port's number
     "environment variable SWITCHYARD_HEALTH_PORT='50053': section 'dispatcher': dispatcher.port and "
     "dispatcher.health_port are both 50053"),
    ({"SWITCHYARD_ENGINE": "openai", "SWITCHYARD_UPSTREAM_MODEL": "  "}, "dispatcher",
     "environment variable SWITCHYARD_UPSTREAM_MODEL='  ': key 'upstream.default_model' has value '  '; "
     "expected: a model id, not blank"),
    ({"SWITCHYARD_TLS_DIR": "/etc/tls", "SWITCHYARD_HEALTH_PORT": "50051"}, "orchestrator",  # only the culprit named
     "environment variable SWITCHYARD_HEALTH_PORT='50051': section 'orchestrator': orchestrator.port and "
     "orchestrator.health_port are both 50051"),
])
def test_a_variable_whose_value_its_key_refuses_is_named_with_its_value(monkeypatch, variables, service, message):
    """A value that passes the variable's own parser and fails its key's rules read 'overrides: key
    'upstream.base_url' has value ...': nothing the operator wrote, and neither the variable nor where it was set."""
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as refused:
        load_config(ROOT / "config", service=service)
    assert str(refused.value).startswith(message), str(refused.value)
    assert "overrides" not in str(refused.value) and "SWITCHYARD_TLS_DIR" not in str(refused.value)


@pytest.mark.parametrize(("filename", "edit", "key"), [
    ("switchyard.json", lambda t: t.replace('"port": 50051', '"port": 50051, "port": 50099', 1), "orchestrator.port"),
    ("switchyard.json", lambda t: t.replace("{", '{"server": {}, ', 1), "server"),  # a whole table twice
    ("queue.json", lambda t: t.replace('"timeout_ms":', '"timeout_ms": 1, "timeout_ms":', 1), ".timeout_ms"),
])
def test_a_json_config_key_given_twice_is_refused_naming_it(config_dir, filename, edit, key):
    """It loaded, the last value silently winning: '"port": 50051, ... "port": 50099' served on 50099 (TOML's
    parser refuses a key twice itself)."""
    path = config_dir / filename
    path.write_text(edit(path.read_text()))
    with pytest.raises(ConfigError) as refused:
        load_config(config_dir)
    message = str(refused.value)
    assert message.startswith(f"{path}: key '") and f"{key}' is given twice; expected each key once" in message, message


def test_a_config_file_that_is_a_folder_or_cannot_be_read_is_named(config_dir, monkeypatch):
    """A folder read 'file not found' beside the file's own name; a file this user cannot read stopped the
    service with a PermissionError traceback from the loader, naming no key."""
    (config_dir / "queue.json").unlink()
    (config_dir / "queue.json").mkdir()
    with pytest.raises(ConfigError, match=r"queue.json: a folder is there, not a file; expected it beside"):
        load_config(config_dir)
    (config_dir / "queue.json").rmdir()
    shutil.copy(ROOT / "config" / "queue.json", config_dir / "queue.json")
    real = Path.read_text

    def no_permission(self, *args, **kwargs):  # the file system's answer to a user without read permission
        if self.name == "queue.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", no_permission)
    with pytest.raises(ConfigError) as refused:
        load_config(config_dir)
    assert str(refused.value) == (f"{config_dir / 'queue.json'}: cannot be read (Permission denied); expected a file "
                                  "this user can read")


def _where_model_sits(model):
    """(section name, keys inside the section's table) of every place ``model`` is read from."""
    from switchyard.common.config import SECTIONS

    def walk(node, path):
        if node is model:
            yield path
        for name, field in node.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                yield from walk(field.annotation, (*path, name))

    return [(name, path) for name, section in SECTIONS.items() for path in walk(section.model, ())]


_RENAMES = [(model, old, new) for model, renames in FORMER_NAMES.items() for old, new in renames.items()]


@pytest.mark.parametrize(("model", "old", "new"), _RENAMES, ids=[f"{old}->{new}" for _, old, new in _RENAMES])
def test_every_former_name_loads_with_a_warning_naming_the_new_one(config_dir, caplog, model, old, new):
    from switchyard.common.config import SECTIONS

    (name, path), *_ = _where_model_sits(model)
    section = SECTIONS[name]
    keys = (*section.keys, *path)
    file = config_dir / section.file
    if file.suffix == ".toml":
        text, count = re.subn(rf"(?m)^{new}(\s*)=", rf"{old}\1=", file.read_text())
        assert count == 1, f"{new} once in {file.name}"
        file.write_text(text)
    else:
        def rename(data):
            for key in keys:
                data = data[key]
            data[old] = data.pop(new)
        _write(config_dir, section.file, rename)
    expected = load_config(ROOT / "config")
    with caplog.at_level("WARNING", logger="switchyard.common.config"):
        cfg = load_config(config_dir)
    dotted = ".".join(keys)
    assert f"key '{dotted + '.' if dotted else ''}{old}' is the former name of '{new}'" in caplog.text

    def value(c):
        node = dict(c)[name.split(".")[0]]
        for part in (*name.split(".")[1:], *path, new):
            node = dict(node)[part]
        return node

    assert value(cfg) == value(expected)


def test_the_dram_tiers_backend_key_is_removed_and_ignored(config_dir, caplog):
    _write(config_dir, "memory_policy.toml", lambda text: text.replace("[dram]\n", '[dram]\nbackend = "redis"\n'))
    with caplog.at_level("WARNING", logger="switchyard.common.config"):
        load_config(config_dir)
    assert "memory_policy.toml: key 'dram.backend' is no longer a setting: the DRAM tier is always Redis" in caplog.text


def test_the_config_package_reads_attributes_by_name_only():
    """No getattr/hasattr probes (nor a __getattr__ hook) in the config package: every read names its field."""
    import ast

    probes = []
    for path in sorted((ROOT / "services" / "switchyard" / "common" / "config").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name) and node.id in {"getattr", "hasattr", "setattr"}:
                probes.append(f"{path.name}:{node.lineno} {node.id}")
            elif isinstance(node, ast.FunctionDef) and node.name in {"__getattr__", "__getattribute__"}:
                probes.append(f"{path.name}:{node.lineno} def {node.name}")
    assert not probes, probes


@pytest.mark.parametrize("values, field", [
    ({"priority_values": {"core": 0}}, "priority_values"),  # normal and batch would go out with no priority
    ({"model_map": {"x": ""}}, "model_map"),  # a request for x would go upstream as model ""
    ({"model_map": {" ": "m1"}}, "model_map"),
    ({"default_model": "  "}, "default_model"),
    ({"fallback_model": " "}, "fallback_model"),
])
def test_a_gateway_config_that_would_send_a_blank_model_or_no_priority_is_refused(values, field):
    from pydantic import ValidationError

    from switchyard.common.config import UpstreamConfig

    with pytest.raises(ValidationError) as caught:
        UpstreamConfig.model_validate(values)
    assert field in str(caught.value) and "expected" in str(caught.value)


def test_a_rule_across_a_sections_keys_names_them_without_dumping_the_section(tmp_path):
    folder = tmp_path / "config"
    shutil.copytree("config", folder)
    queue = json.loads((folder / "queue.json").read_text())
    queue["model_gateway"].update(retry_backoff_initial_s=10.0, retry_backoff_max_s=1.0)
    (folder / "queue.json").write_text(json.dumps(queue))
    with pytest.raises(ConfigError) as caught:
        load_config(folder)
    message = str(caught.value)
    assert "section 'model_gateway': retry_backoff_max_s (1.0) must not be below retry_backoff_initial_s (10.0)" \
        in message, message
    assert "'base_url'" not in message and len(message) < 400


@pytest.mark.parametrize("values, field", [
    ({"base_url": "http://127.0.0.1:99999/v1"}, "base_url"),  # doctor and the dispatcher tracebacked on these
    ({"base_url": "http://127.0.0.1:0/v1"}, "base_url"),  # loaded, and every call was refused
    ({"base_url": "http://vllm server:8000/v1"}, "base_url"),  # loaded, and every call failed to resolve it
    ({"pool": {"endpoints": ["http://127.0.0.1:8000/v1", "http://127.0.0.1:0/v1"]}}, "endpoints"),
    ({"base_url": "http://[::1/v1"}, "base_url"),
    ({"base_url": "http:///v1"}, "base_url"),
    ({"pool": {"endpoints": ["http://127.0.0.1:99999/v1"]}}, "endpoints"),
    ({"pool": {"dns_url": "http://[vllm/v1"}}, "dns_url"),
])
def test_a_gateway_url_that_names_no_server_is_refused_at_load(values, field):
    from pydantic import ValidationError

    from switchyard.common.config import UpstreamConfig

    with pytest.raises(ValidationError) as caught:
        UpstreamConfig.model_validate(values)
    assert field in str(caught.value) and "port in 1-65535" in str(caught.value)


@pytest.mark.parametrize("values, field", [
    ({"base_url": "http://alice:s3cret@127.0.0.1:8000/v1"}, "base_url"),
    ({"base_url": "https://token@api.example.com/v1"}, "base_url"),
    ({"pool": {"endpoints": ["http://127.0.0.1:8000/v1", "http://alice:s3cret@127.0.0.1:8001/v1"]}}, "endpoints"),
    ({"pool": {"dns_url": "http://alice:s3cret@vllm:8000/v1"}}, "dns_url"),
])
def test_a_gateway_url_holding_credentials_is_refused_at_load(values, field):
    """A base URL with user:password@ loaded; on the default transport (aiohttp) every call then failed with
    'ValueError: Cannot combine AUTHORIZATION header with AUTH argument or credentials encoded in URL' (a
    traceback out of switchyard doctor, INTERNAL from the dispatcher), and the URL, credentials included, was
    named in errors, logs and the gateway span's url.full. The key goes in api_key_env, as a bearer token."""
    from pydantic import ValidationError

    from switchyard.common.config import UpstreamConfig

    with pytest.raises(ValidationError) as caught:
        UpstreamConfig.model_validate(values)
    message = str(caught.value)
    assert field in message and "no credentials" in message and "api_key_env" in message, message


@pytest.mark.parametrize("values, field", [
    ({"base_url": "https://x.openai.azure.com/openai/deployments/d?api-version=2024-02-01"}, "base_url"),
    ({"base_url": "http://127.0.0.1:8000/v1?"}, "base_url"),
    ({"base_url": "http://127.0.0.1:8000/v1#top"}, "base_url"),
    ({"pool": {"endpoints": ["http://127.0.0.1:8000/v1", "http://127.0.0.1:8001/v1?key=x"]}}, "endpoints"),
    ({"pool": {"dns_url": "http://vllm:8000/v1?x=1"}}, "dns_url"),
])
def test_a_gateway_url_with_a_query_is_refused_at_load_naming_azures_v1_api(values, field):
    """Azure OpenAI's deployment URL (?api-version=...) loaded, and every call went to
    '...?api-version=2024-02-01/chat/completions': the gateway appends its paths and carries no query."""
    from pydantic import ValidationError

    from switchyard.common.config import UpstreamConfig

    with pytest.raises(ValidationError) as caught:
        UpstreamConfig.model_validate(values)
    message = str(caught.value)
    assert field in message and "a query or fragment" in message and "/openai/v1" in message, message


@pytest.mark.parametrize("values, field, root", [
    ({"base_url": "http://127.0.0.1:8000/v1/chat/completions"}, "base_url", "http://127.0.0.1:8000/v1"),
    ({"base_url": "https://api.openai.com/v1/chat/completions/"}, "base_url", "https://api.openai.com/v1"),
    ({"base_url": "http://127.0.0.1:8080/v1/completions"}, "base_url", "http://127.0.0.1:8080/v1"),
    ({"base_url": "http://127.0.0.1:8000/v1/models"}, "base_url", "http://127.0.0.1:8000/v1"),
    ({"pool": {"endpoints": ["http://a:8000/v1", "http://b:8000/v1/chat/completions"]}}, "endpoints", "http://b:8000/v1"),
    ({"pool": {"dns_url": "http://vllm:8000/v1/chat/completions"}}, "dns_url", "http://vllm:8000/v1"),
])
def test_a_gateway_url_ending_in_an_endpoint_is_refused_at_load_naming_its_root(values, field, root):
    """The server's chat completions URL given for its root loaded, the stack came up healthy, and every call went
    to '.../v1/chat/completions/chat/completions' and failed NOT_FOUND."""
    from pydantic import ValidationError

    from switchyard.common.config import UpstreamConfig

    with pytest.raises(ValidationError) as caught:
        UpstreamConfig.model_validate(values)
    message = str(caught.value)
    assert field in message and "an endpoint the gateway appends itself" in message, message
    assert f"give the API's root, {root})" in message, message
    assert UpstreamConfig.model_validate({"base_url": root}).base_url == root  # the root it names loads


def test_doctor_refuses_a_base_url_holding_credentials_naming_the_option(capsys):
    """It ended in aiohttp's ValueError traceback from the stream probe."""
    from switchyard.gateway import doctor

    with pytest.raises(SystemExit) as exited:
        doctor.main(["--base-url", "http://alice:s3cret@127.0.0.1:1/v1"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--base-url:" in err and "no credentials" in err and "Traceback" not in err, err


def test_a_rule_on_a_table_valued_key_names_the_key_not_a_section(config_dir):
    """scheduler.tenant_weights is a key whose value is a table: its rule is about its entries, and the message
    said "section 'tenant_weights'" with "expected" twice."""
    _write(config_dir, "scheduler_config.json", lambda d: d.update(tenant_weights={"acme": -1}))
    with pytest.raises(ConfigError) as caught:
        load_config(config_dir)
    message = str(caught.value)
    assert "key 'tenant_weights' has value {'acme': -1}; expected: a finite weight > 0 for each tenant" in message
    assert "section" not in message and message.count("expected") == 1


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_number_that_is_not_finite_is_refused_as_such_not_by_a_bound(value):
    """NaN passed every bound but the one it was reported against: 'has value nan; expected: Input should be
    less than or equal to 86400', as if a smaller NaN would do."""
    with pytest.raises(ConfigError, match="key 'scheduler.fairness_half_life_s' has value .*; expected: Input "
                                          "should be a finite number"):
        SwitchyardConfig().with_overrides(**{"scheduler.fairness_half_life_s": value})


@pytest.mark.parametrize(("section", "edit", "message"), [
    ("orchestrator", lambda d: d["orchestrator"]["http"].update(port=d["orchestrator"]["port"]),
     "orchestrator.port and orchestrator.http.port are both 50051"),
    ("retrieval", lambda d: d["retrieval"].update(metrics_port=d["retrieval"]["port"]),
     "retrieval.port and retrieval.metrics_port are both 50052"),
    ("dispatcher", lambda d: d["dispatcher"].update(health_port=d["dispatcher"]["metrics_port"]),
     "dispatcher.metrics_port and dispatcher.health_port are both 9103"),
])
def test_two_listening_ports_of_one_service_set_alike_are_refused_at_load_naming_both(config_dir, section, edit, message):
    """The second bind failed once the service had started, naming neither key ("metrics port
    127.0.0.1:9102 for retrieval: Address already in use")."""
    _write(config_dir, "switchyard.json", edit)
    with pytest.raises(ConfigError, match=re.escape(message + ": expected a port of its own for each")):
        load_config(config_dir, service=section)


def test_free_ports_and_a_disabled_face_never_clash(config_dir):
    _write(config_dir, "switchyard.json", lambda d: (d["retrieval"].update(port=0, metrics_port=0, health_port=0),
                                                     d["orchestrator"]["http"].update(enabled=False, port=50051)))
    config = load_config(config_dir)
    assert (config.retrieval.port, config.retrieval.metrics_port) == (0, 0)
