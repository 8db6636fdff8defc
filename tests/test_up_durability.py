"""Durable means it survives (issue 26, item 2): the embedded Redis of ``switchyard up`` keeps an append-only
file, and no process outlives the one that started it.

- 20 SubmitTasks accepted with the task store on the embedded Redis are all answered after a clean restart of
  ``switchyard up`` on the same data folder;
- ``kill -9`` of the launcher leaves no descendant (redis-server, the services, the orchestrator's CPU-pool
  workers, the multiprocessing resource tracker), and the next start on the same data folder succeeds;
- ``kill -9`` of an orchestrator leaves none of its CPU-pool workers or its resource tracker;
- a service asked for port 0 binds it itself and reports the port it bound (no pick-then-bind race).

Each test kills only processes it started, found as descendants (psutil) of the process it started.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from stack_fixtures import UpStack, loop_executor_config
from test_orchestrator import Downstream

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common import children
from switchyard.common.channels import open_channel
from switchyard.common.config import load_config
from switchyard.common.embedded_redis import EmbeddedRedis, EmbeddedRedisError
from switchyard.common.server import running
from switchyard.launcher import healthy

pytestmark = [pytest.mark.slow, pytest.mark.no_gpu,
              pytest.mark.skipif(not children.SUPPORTED, reason="needs Linux's parent-death signal")]
ROOT = Path(__file__).resolve().parent.parent


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _survivors(procs: list[psutil.Process], timeout: float = 90) -> list[str]:
    """Processes of ``procs`` still alive after up to ``timeout`` seconds (a bound on the wait, not a speed)."""
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    out = []
    for proc in alive:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return out


def _kill_all(procs: list[psutil.Process]) -> None:
    """Clean-up after a failed test: SIGKILL what is left of the processes this test started."""
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


# --------------------------------------------------------------------------- tasks survive a restart


async def _submit(address: str, ids: list[str]) -> None:
    async with open_channel(address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        for task_id in ids:
            await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id=task_id, payload="How does the with statement "
                                                           "work?", task_type="chat", max_tokens=8), timeout=30)


async def _statuses(address: str, ids: list[str]) -> dict[str, int]:
    import grpc

    found = {}
    async with open_channel(address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        for task_id in ids:
            try:
                status = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id=task_id), timeout=30)
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.NOT_FOUND, err
                continue
            found[task_id] = status.state
    return found


async def test_tasks_submitted_to_the_embedded_redis_are_all_answered_after_a_restart_of_switchyard_up(
        pydoc_index_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "redis"
    env = {"SWITCHYARD_TASK_STORE": "redis"}
    args = ("--data-dir", str(data), "--config-dir", str(loop_executor_config(tmp_path)))  # no CPU pool to start
    ids = [f"durable-{i}" for i in range(20)]
    first = UpStack(pydoc_index_dir, env=env, args=args)
    try:
        first.wait_ready()
        await _submit(first.address("orchestrator"), ids)
        before = await _statuses(first.address("orchestrator"), ids)
    finally:
        assert first.stop() == 0
    assert len(before) == 20
    assert (data / "appendonly.aof").stat().st_size > 0 and not (data / "redis.pid").exists()

    second = UpStack(pydoc_index_dir, env=env, args=args)
    try:
        second.wait_ready()
        after = await _statuses(second.address("orchestrator"), ids)
    finally:
        assert second.stop() == 0
    print(f"\naccepted SubmitTasks answered after a restart: {len(after)}/{len(ids)}")
    assert sorted(after) == sorted(ids), f"lost: {sorted(set(ids) - set(after))}"


# --------------------------------------------------------------------------- nothing outlives its parent


async def test_kill_9_of_the_launcher_leaves_no_process_and_the_next_start_succeeds(
        pydoc_index_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "redis"
    stack = UpStack(pydoc_index_dir, args=("--data-dir", str(data)))
    started: list[psutil.Process] = []
    try:
        stack.wait_ready()
        started = _descendants(stack.proc.pid)
        names = " ".join(" ".join(p.cmdline()) for p in started)
        assert "redis-server" in names and names.count("switchyard.cli serve") == 3
        assert "resource_tracker" in names and names.count("multiprocessing.spawn") >= 2  # CPU pool, tracker
        stack.proc.send_signal(signal.SIGKILL)  # the launcher dies without any clean-up of its own
        stack.proc.wait()
        survivors = _survivors(started)
        print(f"\nprocesses left after kill -9 of the launcher: {len(survivors)} of {len(started)}")
        assert survivors == []
    finally:
        _kill_all(started)
        stack.stop()
    # same folder: no "already answers" refusal (no CPU pool this time: the first start's is what was killed)
    again = UpStack(pydoc_index_dir,
                    args=("--data-dir", str(data), "--config-dir", str(loop_executor_config(tmp_path))))
    try:
        again.wait_ready()
    finally:
        assert again.stop() == 0
    # --data-dir holds the stack's stored state, the SQLite task store too (it stayed at data/tasks.sqlite3 of
    # the working folder, beside another stack's)
    assert (data / "appendonly.aof").exists() and (data / "tasks.sqlite3").exists()


def test_kill_9_of_the_embedded_redis_stops_the_stack_naming_it(pydoc_index_dir: Path, tmp_path: Path) -> None:
    """One stack, one fate (docs/architecture.md): the embedded Redis is one of the processes `switchyard up`
    started. Killed, it was neither restarted nor reported: the stack ran on, the orchestrator retrying the
    DRAM tier for ever."""
    stack = UpStack(pydoc_index_dir, args=("--data-dir", str(tmp_path / "redis"),  # no CPU pool to start
                                            "--config-dir", str(loop_executor_config(tmp_path))))
    started: list[psutil.Process] = []
    try:
        stack.wait_ready()
        started = _descendants(stack.proc.pid)
        (redis,) = [p for p in started if "redis-server" in " ".join(p.cmdline())]
        redis.kill()
        assert stack.proc.wait(120) == 1
        said = "".join(stack.lines)
        assert (f"switchyard up: redis (the DRAM tier's embedded redis-server, pid {redis.pid}, "
                f"{stack.redis_address()}) exited with status -9; stopping the others") in said, said
        assert _survivors(started) == []
    finally:
        _kill_all(started)
        stack.stop()


def _orchestrator_config(tmp_path: Path) -> Path:
    folder = tmp_path / "config"
    shutil.copytree(ROOT / "config", folder)
    path = folder / "switchyard.json"
    config = json.loads(path.read_text())
    config["orchestrator"]["cpu_executor"] = "process"
    config["orchestrator"]["cpu_workers"] = 2
    config["orchestrator"]["task_store"]["sqlite_path"] = str(tmp_path / "tasks.sqlite3")
    path.write_text(json.dumps(config))
    return folder


async def test_kill_9_of_an_orchestrator_leaves_no_cpu_worker_or_resource_tracker(tmp_path: Path) -> None:
    config_dir = _orchestrator_config(tmp_path)
    async with running([Downstream()], load_config(config_dir).server) as downstream:
        address = f"127.0.0.1:{downstream.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(SWITCHYARD_RETRIEVAL_ADDR=address, SWITCHYARD_DISPATCHER_ADDR=address)

        async def kill_one(attempt: int) -> list[str]:
            """Start an orchestrator with its CPU pool, kill -9 it once it serves: what is left of what it started."""
            port_file = tmp_path / f"ports-{attempt}.json"
            proc = subprocess.Popen(
                [sys.executable, "-m", "switchyard.cli", "serve", "orchestrator", "--config-dir", str(config_dir),
                 "--port", "0", "--metrics-port", "0", "--http-port", "0", "--port-file", str(port_file)],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            started: list[psutil.Process] = []
            try:
                while not port_file.exists():  # written once both ports are bound, by the orchestrator itself
                    assert proc.poll() is None, f"orchestrator exited with {proc.returncode}"
                    await asyncio.sleep(0.05)
                bound = json.loads(port_file.read_text())
                assert bound["pid"] == proc.pid and bound["port"] > 0 and bound["metrics_port"] > 0
                assert await asyncio.to_thread(healthy, f"127.0.0.1:{bound['port']}", "agent.AgentService")
                started = _descendants(proc.pid)
                cmdlines = [" ".join(p.cmdline()) for p in started]
                assert sum("resource_tracker" in c for c in cmdlines) == 1 and len(started) == 3, cmdlines
                proc.send_signal(signal.SIGKILL)
                await asyncio.to_thread(proc.wait)
                return await asyncio.to_thread(_survivors, started)
            finally:
                _kill_all(started)
                if proc.poll() is None:
                    proc.kill()
                    await asyncio.to_thread(proc.wait)

        # three orchestrators side by side (their starts, each an interpreter and its spawned pool, overlap);
        # each is killed on its own once it serves, and every one of them ends before the test does
        outcomes = await asyncio.gather(*(kill_one(attempt) for attempt in range(3)), return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    left = [survivor for outcome in outcomes for survivor in outcome]
    print(f"\nprocesses left after 3 x kill -9 of an orchestrator: {len(left)}")
    assert left == []


# --------------------------------------------------------------------------- the embedded Redis's data folder


def test_a_data_folder_held_by_a_live_owner_is_refused_and_a_dead_owner_s_server_is_replaced(tmp_path: Path) -> None:
    data = tmp_path / "redis"
    first = EmbeddedRedis("127.0.0.1", 0, data_dir=data).start()
    try:
        with pytest.raises(EmbeddedRedisError, match=rf"in use by pid {os.getpid()}"):
            EmbeddedRedis("127.0.0.1", 0, data_dir=data).start()
    finally:
        first.stop()
    # an owner killed with kill -9 whose redis-server lives on (as on a system without the parent-death
    # signal, or a server of an older version): the next start finds it by its pidfile and replaces it
    owner = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys, time\n"
            "from switchyard.common import children, embedded_redis\n"
            "children._prctl = None  # an owner on a system without the parent-death signal\n"
            f"server = embedded_redis.EmbeddedRedis('127.0.0.1', 0, data_dir={str(data)!r}).start()\n"
            "print(server.proc.pid, server.port, flush=True)\n"
            "time.sleep(600)\n")],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "services")})
    assert owner.stdout is not None
    pid, _port = map(int, owner.stdout.readline().split())
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    stale = psutil.Process(pid)
    try:
        assert stale.is_running() and (data / "redis.pid").read_text().strip() == str(pid)
        second = EmbeddedRedis("127.0.0.1", 0, data_dir=data).start()  # found by its pidfile and replaced
        try:
            assert second.replaced_pid == pid and second.proc is not None and second.proc.pid != pid
            assert _survivors([stale], timeout=30) == []
        finally:
            second.stop()
    finally:
        _kill_all([stale])


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--ready-timeout", "-1", "--ready-timeout: expected a finite number of seconds > 0, got -1.0"),  # gave up at once
    ("--ready-timeout", "nan", "--ready-timeout: expected a finite number of seconds > 0, got nan"),  # waited forever
    ("--data-dir", "FILE", "--data-dir: expected a folder this user can make or write, got "),  # a traceback
    ("--data-dir", "FILE/sub", "--data-dir: expected a folder this user can make or write, got "),
])
def test_an_option_of_switchyard_up_it_cannot_use_is_refused_naming_it_before_anything_starts(
        tmp_path: Path, capsys, option: str, value: str, message: str) -> None:
    from switchyard.launcher import main as up_main

    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    with pytest.raises(SystemExit) as refused:
        up_main(["--free-ports", "--data-dir", str(tmp_path / "data"), option, value.replace("FILE", str(a_file))])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "data" / "redis.pid").exists()  # refused before the Redis started


def test_a_ready_timeout_that_runs_out_names_the_option_to_raise(tmp_path: Path, capsys) -> None:
    """A service still starting when --ready-timeout ran out: up said 'retrieval not healthy after 0 s' (0.01
    rounded to none) and not which option to raise; it stops what it started, exit 1."""
    from switchyard.launcher import main as up_main

    assert up_main(["--free-ports", "--data-dir", str(tmp_path / "data"), "--ready-timeout", "0.01"]) == 1
    err = capsys.readouterr().err
    assert "not healthy after 0.01 s (--ready-timeout): raise it if the service was still starting" in err, err


def test_an_address_variable_switchyard_up_sets_itself_is_said_not_to_be_used(tmp_path: Path, capsys,
                                                                            monkeypatch) -> None:
    """SWITCHYARD_DISPATCHER_ADDR (a dispatcher of the user's elsewhere) and SWITCHYARD_RETRIEVAL_ADDR were dropped
    without a word: up wires the orchestrator to the services it starts. One line each says so, at start (here
    the stack is refused right after, for a port clash, so that nothing starts)."""
    from switchyard.launcher import main as up_main

    monkeypatch.setenv("SWITCHYARD_DISPATCHER_ADDR", "10.0.0.7:50053")
    monkeypatch.setenv("SWITCHYARD_RETRIEVAL_ADDR", "10.0.0.8:50052")
    monkeypatch.setenv("SWITCHYARD_HEALTH_PORT", "51790")  # every service's health port: refused before any start
    assert up_main(["--data-dir", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    for variable, value, service in (("SWITCHYARD_DISPATCHER_ADDR", "10.0.0.7:50053", "dispatcher"),
                                     ("SWITCHYARD_RETRIEVAL_ADDR", "10.0.0.8:50052", "retrieval")):
        assert (f"switchyard up: {variable}={value} is not used: up starts its own {service} and wires the services "
                "to it (to use that address, start the services with `switchyard serve` instead)") in err, err


@pytest.mark.parametrize(("changes", "args", "message"), [
    ({"dispatcher.port": "retrieval.port"}, (), "retrieval.port and dispatcher.port are both 51774"),
    ({"orchestrator.http.port": "retrieval.metrics_port"}, (), "retrieval.metrics_port and orchestrator.http.port are "
                                                               "both 51775"),
    ({"dispatcher.metrics_port": 51770}, ("--dispatchers", "2"),  # its second replica's, on the orchestrator's
     "dispatcher.metrics_port + 1 (dispatcher-2) and orchestrator.port are both 51771"),
    ({"dispatcher.port": 65535}, ("--dispatchers", "2"),
     "dispatcher.port + 1 (dispatcher-2) is 65536: expected a TCP port, 1 to 65535"),
    ({"[dram] port": "orchestrator.metrics_port"}, (), "orchestrator.metrics_port and memory_policy.toml [dram] port "
                                                       "are both 51772"),
    ({"SWITCHYARD_HEALTH_PORT": "51790"}, (),  # one variable, every service's health port (--free-ports frees it)
     "retrieval.health_port and dispatcher.health_port are both 51790: expected a port of its own for each (0 picks "
     "a free one) (SWITCHYARD_HEALTH_PORT sets the health_port of every service it starts)"),
])
def test_two_services_of_switchyard_up_on_one_port_are_refused_naming_both_before_anything_starts(
        tmp_path: Path, capsys, monkeypatch, changes: dict, args: tuple, message: str) -> None:
    """Each service's own ports are checked at load; two services' (or a dispatcher replica's port + i) met only
    at the second bind, once Redis and the first had started: 'could not bind 127.0.0.1:51774: is another process
    using it?', the other process being the stack's own."""
    import tomllib

    from switchyard.launcher import main as up_main

    config_dir = tmp_path / "config"
    shutil.copytree(Path(__file__).resolve().parent.parent / "config", config_dir)
    doc = json.loads((config_dir / "switchyard.json").read_text())
    ports = {"orchestrator": (51771, 51772), "retrieval": (51774, 51775), "dispatcher": (51776, 51777)}
    for section, (port, metrics_port) in ports.items():
        doc[section]["port"], doc[section]["metrics_port"] = port, metrics_port
    doc["orchestrator"]["http"]["port"] = 51773
    policy = (config_dir / "memory_policy.toml").read_text().replace("port = 6379", "port = 51778")
    for key, value in changes.items():
        if key.startswith("SWITCHYARD_"):
            monkeypatch.setenv(key, value)
            continue
        if isinstance(value, str):  # another key's port
            section, leaf = value.split(".")
            value = doc[section][leaf]
        if key == "[dram] port":
            policy = policy.replace("port = 51778", f"port = {value}")
            continue
        node = doc
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    (config_dir / "switchyard.json").write_text(json.dumps(doc))
    (config_dir / "memory_policy.toml").write_text(policy)
    assert tomllib.loads(policy)["dram"]["port"]  # still a valid file
    data = tmp_path / "data"
    assert up_main(["--config-dir", str(config_dir), "--data-dir", str(data), *args]) == 2
    err = capsys.readouterr().err
    assert f"switchyard up: bad configuration:\n{message}" in err, err
    assert not (data / "redis.pid").exists()  # refused before the Redis started, or any service


@pytest.mark.parametrize(("settings", "dispatchers", "message"), [
    ({"dispatcher": {"health_port": 18186}, "retrieval": {"health_port": 18187}}, 2,
     "retrieval.health_port and dispatcher.health_port + 1 (dispatcher-2) are both 18187"),
    ({"dispatcher": {"port": 0, "metrics_port": 0, "health_port": 0}, "retrieval": {"metrics_port": 9101}}, 3,
     "retrieval.metrics_port and orchestrator.metrics_port are both 9101"),
])
def test_the_port_check_of_switchyard_up_takes_each_dispatcher_replica_s_ports_as_it_binds_them(
        tmp_path: Path, capsys, settings: dict, dispatchers: int, message: str) -> None:
    # Replica i of the dispatcher binds its configured health port + i, as its port and metrics port (it bound
    # the first replica's, so the second failed 'could not bind the health port'); a port set to 0 is a free
    # one for each replica (it was 0 + i: port 1, 2, ..., refused as 'dispatcher.port + 1 (--dispatchers 3) and
    # dispatcher.metrics_port + 1 (--dispatchers 3) are both 1').
    from switchyard.launcher import main as up_main

    config_dir = tmp_path / "config"
    shutil.copytree(ROOT / "config", config_dir)
    config = json.loads((config_dir / "switchyard.json").read_text())
    for section, values in settings.items():
        config[section].update(values)
    (config_dir / "switchyard.json").write_text(json.dumps(config))
    code = up_main(["--config-dir", str(config_dir), "--data-dir", str(tmp_path / "data"),
                    "--dispatchers", str(dispatchers)])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "data" / "redis.pid").exists()  # refused before the Redis started


def test_free_ports_frees_the_health_ports_of_every_service_and_dispatcher_replica(
        pydoc_index_dir: Path, tmp_path: Path) -> None:
    # SWITCHYARD_HEALTH_PORT sets the three services' health port (kubelet's plain-text probes under TLS); with
    # --free-ports each service and each dispatcher replica bound that one port, so the second to start failed
    # 'could not bind the health port 127.0.0.1:N' and the stack did not start.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        health_port = s.getsockname()[1]
    stack = UpStack(pydoc_index_dir, env={"SWITCHYARD_HEALTH_PORT": str(health_port)},
                    args=("--dispatchers", "2", "--data-dir", str(tmp_path / "data"),
                          "--config-dir", str(loop_executor_config(tmp_path))))  # no CPU pool to start
    try:
        stack.wait_ready()
        assert set(stack.endpoints()) >= {"dispatcher", "dispatcher-2", "retrieval", "orchestrator"}
    finally:
        assert stack.stop() == 0


def test_a_port_another_program_holds_is_refused_naming_its_key_and_free_ports_before_anything_starts(
        tmp_path: Path, capsys) -> None:
    # Before: Redis, retrieval and the dispatcher started, then the orchestrator failed with "[Errno 98] HTTP face
    # 127.0.0.1:8080 (orchestrator.http.port): ... address already in use" and up with "orchestrator exited with
    # status 1 during start-up (see its log above)", saying nothing of --free-ports.
    import socket

    from switchyard.launcher import main as up_main

    config_dir = tmp_path / "config"
    shutil.copytree(ROOT / "config", config_dir)
    settings = json.loads((config_dir / "switchyard.json").read_text())
    for section in ("orchestrator", "retrieval", "dispatcher"):  # 0: a free port, so only the one below is taken
        settings[section]["port"] = settings[section]["metrics_port"] = 0
    with socket.create_server(("127.0.0.1", 0)) as holder:  # another program on the HTTP face's port
        settings["orchestrator"]["http"]["port"] = port = holder.getsockname()[1]
        (config_dir / "switchyard.json").write_text(json.dumps(settings))
        code = up_main(["--config-dir", str(config_dir), "--data-dir", str(tmp_path / "data")])
    assert code == 1
    err = capsys.readouterr().err
    assert f"switchyard up: port {port} (orchestrator.http.port) on 127.0.0.1 is in use" in err, err
    assert "start this stack with --free-ports" in err, err
    assert not (tmp_path / "data" / "redis.pid").exists()  # refused before the Redis started


def test_an_embedded_redis_folder_that_is_a_file_is_named_not_a_traceback(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    for folder in (a_file, a_file / "sub"):  # memory_policy.toml [dram] embedded_data_dir, or --data-dir
        with pytest.raises(EmbeddedRedisError, match=r"the Redis data folder .* cannot be made or written \((a file "
                                                     r"is there|Not a directory)\): name a folder"):
            EmbeddedRedis("127.0.0.1", 0, data_dir=folder).start()


@pytest.mark.parametrize("appendfsync", ["always", "everysec"])
def test_the_embedded_redis_keeps_its_data_across_a_restart_only_with_a_data_folder(
        tmp_path: Path, appendfsync: str) -> None:
    import redis

    def write_then_restart(server: EmbeddedRedis) -> bytes | None:
        server.start()
        try:
            with redis.Redis(host=server.host, port=server.port) as client:
                if server.data_dir is not None:
                    assert client.config_get("appendfsync") == {"appendfsync": server.appendfsync}
                    assert client.config_get("appendonly") == {"appendonly": "yes"}
                client.set("switchyard:probe", b"kept")
        finally:
            server.stop()
        server.start()
        try:
            with redis.Redis(host=server.host, port=server.port) as client:
                return client.get("switchyard:probe")
        finally:
            server.stop()

    persistent = EmbeddedRedis("127.0.0.1", 0, data_dir=tmp_path / "redis", appendfsync=appendfsync)  # type: ignore[arg-type]
    assert write_then_restart(persistent) == b"kept"
    assert (tmp_path / "redis" / "appendonly.aof").is_file()
    assert write_then_restart(EmbeddedRedis("127.0.0.1", 0)) is None  # the tests' cache: no data folder


def test_a_second_stack_keeps_the_first_stacks_up_file_and_says_where_its_own_is(tmp_path, monkeypatch, capsys):
    """A second `switchyard up` replaced the one up file of the user, and the first stack's `switchyard top`
    and locust watch file read the second's figures without a word. The file of a live launcher is kept."""
    from switchyard import launcher

    monkeypatch.delenv("SWITCHYARD_UP_FILE", raising=False)
    path = tmp_path / "up.json"
    assert launcher._own_up_file(path) == path  # none yet
    other = subprocess.Popen(["sleep", "60"])
    try:
        path.write_text(json.dumps({"pid": other.pid, "services": {}}))
        own = launcher._own_up_file(path)
        assert own == tmp_path / f"up-{os.getpid()}.json"
        said = capsys.readouterr().out
        assert f"pid {other.pid}" in said and f"SWITCHYARD_UP_FILE={own}" in said
    finally:
        other.kill()
        other.wait()
    assert launcher._own_up_file(path) == path  # its launcher is gone: the file is free
    path.write_text(json.dumps({"pid": os.getpid(), "services": {}}))
    assert launcher._own_up_file(path) == path
    monkeypatch.setenv("SWITCHYARD_UP_FILE", str(path))  # named by the user: that file, whoever wrote it
    path.write_text(json.dumps({"pid": os.getppid(), "services": {}}))
    assert launcher._own_up_file(path) == path


def _dead_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def test_an_up_file_whose_launcher_is_gone_is_removed_by_the_next_reader(tmp_path):
    """A killed launcher's up file stayed, naming ports nothing serves; the next reader removes it and reads
    on. A live launcher's file, and one that cannot be read, are kept."""
    from switchyard.common.up_files import remove_stale

    dead = _dead_pid()
    live = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "up.json").write_text(json.dumps({"pid": dead, "services": {}}))
        (tmp_path / f"up-{dead}.json").write_text(json.dumps({"pid": dead, "services": {}}))
        (tmp_path / f"up-{live.pid}.json").write_text(json.dumps({"pid": live.pid, "services": {}}))
        (tmp_path / "up-7.json").write_text("{")  # half written, or not an up file: not ours to judge
        (tmp_path / "other.json").write_text(json.dumps({"pid": dead}))
        removed = remove_stale(tmp_path / "up.json")
        assert sorted(removed) == sorted([(tmp_path / "up.json", dead), (tmp_path / f"up-{dead}.json", dead)])
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"up-{live.pid}.json", "up-7.json", "other.json"])
        assert remove_stale(tmp_path / "absent" / "up.json") == []
    finally:
        live.kill()
        live.wait()


def test_the_up_file_of_a_killed_switchyard_up_is_removed_by_top(tmp_path):
    """`kill -9` of `switchyard up` left its up file behind; `switchyard top` read the dead stack's ports."""
    up_file = tmp_path / "up.json"
    env = {**os.environ, "SWITCHYARD_UP_FILE": str(up_file)}
    launcher = subprocess.Popen([sys.executable, "-m", "switchyard.cli", "up", "--free-ports", "--data-dir",
                                 str(tmp_path / "data")], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                cwd=Path(__file__).resolve().parent.parent)
    try:
        for _ in range(600):  # the launcher claims the file before its services are healthy
            if up_file.exists() and json.loads(up_file.read_text()).get("pid") == launcher.pid:
                break
            assert launcher.poll() is None
            time.sleep(0.05)
        else:
            raise AssertionError("switchyard up wrote no up file")
    finally:
        launcher.kill()
        launcher.wait()
    assert up_file.exists()  # no clean-up ran
    top = subprocess.run([sys.executable, "-m", "switchyard.cli", "top", "--once", "--json"], env=env,
                         capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parent.parent)
    assert not up_file.exists(), top.stdout + top.stderr
    assert "Traceback" not in top.stderr
