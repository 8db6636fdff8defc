"""Config files load with the documented values; bad files fail with file, key, value and expectation."""

import json
import shutil
from pathlib import Path

import pytest

from switchyard.common.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def config_dir(tmp_path):
    target = tmp_path / "config"
    shutil.copytree(ROOT / "config", target)
    return target


def test_shipped_config_has_design_values():
    cfg = load_config(ROOT / "config")
    q = cfg.queue.queues
    assert (q.orchestration.capacity, q.orchestration.workers, q.orchestration.timeout_ms) == (2048, 16, 3000)
    assert (q.retrieval.capacity, q.retrieval.workers, q.retrieval.timeout_ms) == (1024, 8, 2000)
    assert (q.inference.capacity, q.inference.workers, q.inference.timeout_ms) == (512, 4, 30000)
    assert cfg.queue.flush.max_batch_size == 32 and cfg.queue.flush.flush_interval_ms == 20
    assert cfg.queue.model_gateway.default_model == "claude-sonnet-4-5"
    assert cfg.queue.model_gateway.fallback_model == "gpt-4o-mini"
    s = cfg.scheduler
    assert s.time_slice_ms == 20 and s.max_running_agents == 10
    assert (s.compute_score_weights.cuda_util, s.compute_score_weights.tensor_util) == (0.2, 0.6)
    assert (s.low_load_threshold, s.high_load_threshold) == (30, 80)
    assert (s.priority_boost.core, s.priority_boost.normal, s.priority_boost.batch) == (10, 5, 1)
    assert s.preemption_enabled and s.preemption_grace_ms == 50
    m = cfg.memory
    assert m.hbm.capacity_ratio == 0.85 and m.hbm.emergency_evict_ratio == 0.9
    assert m.dram.backend == "redis" and m.dram.port == 6379
    assert m.oss.archive_interval_sec == 3600 and m.scan.hbm_scan_interval_sec == 300


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
    with pytest.raises(ConfigError, match=r"scheduler_config.json: key 'time_slise_ms'.*no such key"):
        load_config(config_dir)


def test_cross_field_check_quotes_values(config_dir):
    path = config_dir / "scheduler_config.json"
    data = json.loads(path.read_text())
    data["low_load_threshold"] = 90
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"low_load_threshold \(90.0\) must be below high_load_threshold \(80.0\)"):
        load_config(config_dir)


def test_bad_toml_names_file(config_dir):
    (config_dir / "memory_policy.toml").write_text("[hbm\ncapacity_ratio = ")
    with pytest.raises(ConfigError, match=r"memory_policy.toml: not valid TOML"):
        load_config(config_dir)


def test_weights_must_sum_to_one(config_dir):
    path = config_dir / "scheduler_config.json"
    data = json.loads(path.read_text())
    data["compute_score_weights"]["tensor_util"] = 0.9
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"compute_score_weights.*sum to 1.0"):
        load_config(config_dir)


def test_engine_env_overrides_config(monkeypatch):
    monkeypatch.setenv("SWITCHYARD_ENGINE", "openai")
    assert load_config(ROOT / "config").service.dispatcher.engine == "openai"
    monkeypatch.setenv("SWITCHYARD_ENGINE", "tpu")
    with pytest.raises(ValueError, match="SWITCHYARD_ENGINE='tpu'.*expected one of"):
        load_config(ROOT / "config")


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
