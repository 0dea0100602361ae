"""scripts/two_hosts.py with both "hosts" on this machine (127.0.0.1): the series' table on
shm and tcp, the ways the two find each other (--peer, MASTER_ADDR, torchrun's and Slurm's
variables), bad input, and a host gone mid-run.

fi_rma_bw is found as common/bench.py tools_prefix finds it for the scripts
(FABTESTS_PREFIX/bin; LIBFABRIC_PREFIX/bin where the binding loads that libfabric; else
.deps/libfabric/bin): the baseline part is skipped, with the reason, where it is absent.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from scripts import two_hosts
from common.baselines import measure, rma_bw_command, rma_bw_gbps
from common.chapter_pair import ROOT
from tests.support import fake_info
from tests.support.fabtests import rma_bw_missing
from tests.support.gpu import needs_gpu
from tests.support.one_line_errors import assert_one_line_error

SCRIPT = str(ROOT / "scripts" / "two_hosts.py")
TINY = ["--sizes", "4K", "--bytes", "800K", "--repeats", "1"]  # 200 WRITEs of 4 KiB a run
LIMIT = 600  # seconds for the longest case: eight chapters on a busy 2-core machine


def free_port():
    """A PORT whose PORT + 1 (the rendezvous) and PORT + 2 (fi_rma_bw's) are free now."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1] - 1
        try:
            for p in (port + 1, port + 2):
                socket.create_server(("", p)).close()
            return port
        except OSError:
            continue


def start(*args, env=None):
    return subprocess.Popen([sys.executable, SCRIPT, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ, **(env or {})))


def both(args, envs=({}, {})):
    """The two "hosts" at once, each with its env: [(returncode, stdout, stderr)]."""
    procs = [start(*args, env=env) for env in envs]
    try:
        outputs = [p.communicate(timeout=LIMIT) for p in procs]
        return [(p.returncode, *o) for p, o in zip(procs, outputs)]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def assert_ranks_0_and_1(results):
    assert [rc for rc, _, _ in results] == [0, 0], results
    said = sorted(out.count("two_hosts: rank 0 (servers)") for _, out, _ in results)
    assert said == [0, 1], results


@pytest.fixture(params=["shm", "tcp"])
def provider(request):
    return request.param


@pytest.mark.long
def test_the_series_table_between_two_hosts_on_loopback(provider, tmp_path):
    missing = rma_bw_missing()
    report = tmp_path / "report.json"
    port = free_port()
    results = both(["--peer", "127.0.0.1", "--port", str(port), "-p", provider, *TINY,
                    "--nics-per-gpu", "2", "--out", str(report),
                    *(["--no-baseline"] if missing else [])])
    assert_ranks_0_and_1(results)
    data = json.loads(report.read_text())
    assert data["complete"] and data["stopped"] is None
    # a field holds data: the provider's name, and why it was chosen in a field of its own
    assert data["provider"].split(";")[0] == provider and data["provider_why"] == "asked for"
    assert [t["chapter"] for t in data["table"]] == ["07", "09", "10", "11", "12", "13", "14",
                                                     "15"], data["table"]
    blog = json.loads((ROOT / "results" / "blog_p5.json").read_text())
    for line in data["table"]:  # ours beside the blog's
        assert line["gbps"] > 0 and line["size"] == 4096
        assert line["p5_gbps"] == blog["chapters"][line["chapter"]]["gbps"]
    for _, out, _ in results:  # the table, printed on both hosts
        assert "p5 Gbps" in out and "\n15 " in out
    # the server's address went over the rendezvous: in rank 1's command, in no argument
    command = data["runs"][0]["command"]["rank 1"].split()
    assert command[1:4] == ["chapters/07_queue.py", "-p", provider]
    assert int(command[4], 16) and not any(command[4] in h["command"] for h in data["hosts"])
    assert all(h["libfabric"]["path"] and h["libfabric"]["version"] for h in data["hosts"])
    if missing:
        pytest.skip(f"the chapters ran; the fi_rma_bw baseline did not: {missing}")
    one, two = [r for r in data["runs"] if r["tool"].startswith("fi_rma_bw")]
    assert (one["tool"], two["tool"]) == ("fi_rma_bw, 1 NIC pair", "fi_rma_bw, 2 NIC pairs")
    assert one["median_gbps"] > 0 and two["median_gbps"] > 0
    # one pair per (virtual) NIC of 09-15, at once, each on a port of its own
    assert [c.split()[3] for c in two["command"]["rank 0"]] == [f"-E={port + 2}",
                                                                 f"-E={port + 3}"]
    assert all(c.endswith(" 127.0.0.1") for c in two["command"]["rank 1"])
    for line in data["table"]:
        assert line["baseline"] == (one if line["chapter"] == "07" else two)["tool"]
        assert line["percent_of_baseline"] > 0
        assert line["links_gbps"] is None  # shm and tcp report no link speed


@pytest.mark.long
@pytest.mark.parametrize("how", ["MASTER_ADDR", "torchrun", "Slurm"])
def test_the_hosts_meet_as_their_launcher_says(how, tmp_path):
    port = str(free_port())
    if how == "MASTER_ADDR":  # the same command on both: the first started is rank 0
        envs = [{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}] * 2
    elif how == "torchrun":
        envs = [{"RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": port} for r in (1, 0)]
    else:  # srun -N 2: rank 0's host is the first of the node list
        envs = [{"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST":
                 "127.0.0.[1-2]", "MASTER_PORT": port} for r in (1, 0)]
    results = both(["-p", "shm", "--chapters", "7", "--no-baseline", *TINY,
                    "--out", str(tmp_path / "report.json")], envs)
    assert_ranks_0_and_1(results)
    if how != "MASTER_ADDR":  # the rank is the launcher's: rank 1 was started first
        assert "two_hosts: rank 1 (clients)" in results[0][1]
    assert json.loads((tmp_path / "report.json").read_text())["complete"]


def test_rank_0_is_the_first_host_of_a_slurm_node_list():
    assert two_hosts.first_host("p5-[003-004,9],login") == "p5-003"
    assert two_hosts.first_host("gpu7,gpu8") == "gpu7"
    assert two_hosts.first_host("node[01-02]-ib") == "node01-ib"
    args = SimpleNamespace(peer=None, port=None, rank=None)
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "127.0.0.[1-2]"}
    assert two_hosts.meeting(args, env) == (1, "127.0.0.1", two_hosts.PORT, "Slurm variables")


@pytest.mark.parametrize("args,env,pattern", [
    (["-p", "nosuch"], {}, "unknown provider 'nosuch'"),
    (["-p", "efa"], {}, "provider 'efa' has no usable device here"),
    (["--peer", "no-such-host.invalid"], {}, "cannot resolve host 'no-such-host.invalid'"),
    ([], {}, "where is the other host? --peer HOST"),
    (["--chapters", "7,8"], {}, "--chapters takes chapter numbers"),
    (["--sizes", "4Q"], {}, "--sizes takes sizes like 4K,64K"),
    ([], {"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_STEP_NODELIST": "127.0.0.1"},
     "two hosts, one rank each: the Slurm variables say 3 ranks"),
])
def test_bad_input_is_one_line_before_anything_runs(args, env, pattern, tmp_path):
    if "efa" in args:
        fake_info.skip_where_present("efa")
    peer = [] if "--peer" in args or env or pattern.startswith("where") else \
        ["--peer", "127.0.0.1"]
    done = subprocess.run([sys.executable, SCRIPT, *peer, "--no-baseline", *args,
                           "--out", str(tmp_path / "report.json")], capture_output=True,
                          text=True, cwd=ROOT, timeout=60, env=dict(os.environ, **env))
    assert_one_line_error(done, pattern)
    assert not (tmp_path / "report.json").exists()


def test_no_fi_rma_bw_is_one_line_naming_the_build(tmp_path):
    done = subprocess.run([sys.executable, SCRIPT, "--peer", "127.0.0.1", "-p", "shm",
                           "--out", str(tmp_path / "report.json")], capture_output=True,
                          text=True, cwd=ROOT, timeout=60,
                          env=dict(os.environ, FABTESTS_PREFIX=str(tmp_path)))
    assert_one_line_error(done, f"{tmp_path}/bin/fi_rma_bw not found (fabtests are not in "
                                "Debian's packages): build libfabric and fabtests with "
                                "`bash scripts/build_libfabric.sh`")
    assert not (tmp_path / "report.json").exists()


@pytest.mark.long
def test_an_unreachable_peer_is_one_line(tmp_path):
    port = str(free_port())  # nobody serves there: rank 1 waits --wait seconds, then says so
    done = subprocess.run([sys.executable, SCRIPT, "--peer", "127.0.0.1", "--rank", "1",
                           "--port", port, "--wait", "1", "-p", "shm", "--no-baseline",
                           "--out", str(tmp_path / "report.json")], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert_one_line_error(done, f"no rendezvous at 127.0.0.1:{int(port) + 1} within 1 s")
    assert not (tmp_path / "report.json").exists()


@pytest.mark.long
def test_hosts_started_differently_both_stop_in_one_line(tmp_path):
    port = str(free_port())
    common = ["--peer", "127.0.0.1", "--port", port, "-p", "shm", "--no-baseline",
              "--out", str(tmp_path / "report.json")]
    procs = [start(*common, "--sizes", size) for size in ("4K", "8K")]
    try:
        done = [SimpleNamespace(stderr=p.communicate(timeout=LIMIT)[1], returncode=p.returncode)
                for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for d in done:
        assert_one_line_error(d, "the two hosts were started with different arguments: sizes")
    assert not (tmp_path / "report.json").exists()


def started(pid, within=60.0):
    """Wait until process `pid` has a child: its next step's program is running."""
    deadline = time.monotonic() + within
    while not Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        assert time.monotonic() < deadline, f"pid {pid} started no program in {within:g} s"
        time.sleep(0.01)


@pytest.mark.long
@pytest.mark.parametrize("gone,how", [(0, signal.SIGTERM), (1, signal.SIGTERM),
                                       (0, signal.SIGKILL)])
def test_a_host_gone_mid_run_stops_the_other_which_keeps_what_was_measured(gone, how, tmp_path):
    """SIGTERM: the host stops its own programs, says no goodbye. SIGKILL: the kernel stops
    them (common.launch.owned); the fixture checks that none is left either way."""
    port = str(free_port())
    reports = [tmp_path / f"rank{r}.json" for r in (0, 1)]
    procs = [start("--peer", "127.0.0.1", "--rank", str(r), "--port", port, "-p", "shm",
                   "--chapters", "7", "--no-baseline", "--sizes", "4K,8K,16K,32K,64K,128K",
                   "--bytes", "800K", "--repeats", "1", "--out", str(reports[r]))
             for r in (0, 1)]
    try:
        while "4096 B  median" not in (line := procs[gone].stdout.readline()):
            assert line, procs[gone].communicate()  # ended before its first figure
        started(procs[gone].pid)
        procs[gone].send_signal(how)
        _, err = procs[1 - gone].communicate(timeout=LIMIT)
        procs[gone].communicate(timeout=LIMIT)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[1 - gone].returncode == 1
    # rank 0 serves the rendezvous: when it goes, rank 1 hears either its last word or the
    # connection closing, whichever comes first
    said = {f"stopping: rank {gone} is gone (its connection to the rendezvous closed without "
            "a goodbye: killed or crashed)"}
    if gone == 0:
        said.add("the rendezvous closed (its host, rank 0 or the launcher, is gone)")
    assert err.strip() in {f"two_hosts.py: error: {s}" for s in said}, err
    kept = json.loads(reports[1 - gone].read_text())
    assert not kept["complete"] and kept["stopped"]
    assert kept["runs"][0]["size"] == 4096 and kept["runs"][0]["gbps"][0] > 0
    assert [t["size"] for t in kept["table"]][0] == 4096


@needs_gpu
def test_gpu_memory_on_both_hosts(tmp_path):
    """Both "hosts" on this machine's GPU 0: 07 and 09 from GPU memory into GPU memory, and
    fi_rma_bw -D cuda where fabtests are there."""
    missing = rma_bw_missing()
    report = tmp_path / "report.json"
    results = both(["--peer", "127.0.0.1", "--port", str(free_port()), "-p", "shm", "--gpus", "0",
                    "--chapters", "7,9", "--sizes", "64K", "--bytes", "64M", "--repeats", "1",
                    "--out", str(report), *(["--no-baseline"] if missing else [])])
    assert_ranks_0_and_1(results)
    data = json.loads(report.read_text())
    assert data["complete"] and data["memory"] == "cuda"
    assert [t["chapter"] for t in data["table"]] == ["07", "09"]
    assert "--gpu 0" in data["runs"][0]["command"]["rank 1"]
    assert "--gpus 0" in data["runs"][1]["command"]["rank 1"]
    assert all(h["machine"]["gpu"] for h in data["hosts"])
    if missing:
        pytest.skip(f"the chapters ran; the fi_rma_bw baseline did not: {missing}")
    [rma] = [r for r in data["runs"] if r["tool"].startswith("fi_rma_bw")]
    assert "-D cuda -i 0" in rma["command"]["rank 1"][0] and rma["median_gbps"] > 0


def test_what_was_measured_is_kept_when_a_run_fails():
    calls = []

    def tool(size, iters):
        calls.append(size)
        if len(calls) == 2:
            raise TimeoutError("the other host went silent")
        return 1.5, "a command"
    rows = []
    with pytest.raises(TimeoutError):
        measure([("tool", tool)], [4096, 8192], 1, 1 << 20, rows)
    assert [(r["size"], r["gbps"]) for r in rows] == [(4096, [1.5]), (8192, [])]


def test_fi_rma_bw_without_figures_is_an_error_not_a_crash():
    assert rma_bw_gbps("bytes iters total time MB/sec usec/xfer Mxfers/sec\n"
                       "64k     200     12m   0.01s   1000.00  65.54  0.02\n") == 8.0
    with pytest.raises(RuntimeError, match="fi_rma_bw printed no figures: fi_getinfo"):
        rma_bw_gbps("fi_getinfo(): -61\n")


def test_on_a_p5_the_ceiling_is_the_sum_of_the_links_and_each_nic_pair_is_named(
        tmp_path, monkeypatch):
    """Without the hardware: a p5's 32 NICs of 100 Gbps as here() would list them."""
    def nics(count):
        return [{"fabric": "efa", "domain": f"rdmap{79 + i}s0-rdm", "gpu": i // 4, "gbps": 100.0,
                 "real": True} for i in range(count)]
    hosts = [{"nic_07": nics(1), "lanes": nics(32)}] * 2
    many = "fi_rma_bw, 32 NIC pairs"
    rows = [{"tool": "chapter 07", "size": 65536, "gbps": [97.4], "median_gbps": 97.4},
            {"tool": "chapter 15", "size": 65536, "gbps": [3108.3], "median_gbps": 3108.3},
            {"tool": "fi_rma_bw, 1 NIC pair", "size": 65536, "gbps": [94.8], "median_gbps": 94.8},
            {"tool": many, "size": 65536, "gbps": [3000.0, 2900.0]}]  # its median not in yet
    lines = two_hosts.table(rows, hosts, {7: "fi_rma_bw, 1 NIC pair", 15: many})
    assert [(t["chapter"], t["links_gbps"], t["percent_of_links"]) for t in lines] == \
        [("07", 100.0, 97.4), ("15", 3200.0, 97.134)]
    assert lines[1]["baseline_gbps"] == 2950.0 and lines[1]["p5_percent"] == 97.1
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "fi_rma_bw").touch()
    monkeypatch.setenv("FABTESTS_PREFIX", str(tmp_path))
    command = rma_bw_command("efa", "write", 65536, 1000, 3, 29502, ("efa", "rdmap79s0-rdm"))
    assert command[1:] == ["-p", "efa", "-E=29502", "-o", "write", "-S", "65536", "-I", "1000",
                           "-f", "efa", "-d", "rdmap79s0-rdm", "-D", "cuda", "-i", "3"]
