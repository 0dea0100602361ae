"""Chapters 03-05 as real programs: a server and a client on this host, per provider."""
import os
import re
import subprocess
import sys

import pytest

from common.chapter_pair import chapter_path, local_env, run_pair
from tests.support import fake_info
from tests.support.budget import Budget


def run_chapter(number, *args, timeout=60):
    return Budget(timeout).run([sys.executable, str(chapter_path(number)), *args],
                               env=local_env())


# The fi_info tool of the same libfabric the binding was built against.
FI_INFO = os.path.join(os.environ.get("LIBFABRIC_PREFIX", "/usr"), "bin", "fi_info")


def fi_info_pairs(*args):
    """(provider, domain) pairs as the fi_info tool prints them."""
    out = subprocess.run([FI_INFO, *args], capture_output=True, text=True,
                         env=local_env(), check=True).stdout
    return set(re.findall(r"^provider: (\S+)\n\s+fabric: .*\n\s+domain: (\S+)$", out, re.M))


def chapter03_pairs(*args):
    done = run_chapter(3, *args)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("provider "))
    rows = lines[header + 1:-1]  # between the header and the summary (a /dev/shm sweep may
    #                              have printed a line before the version)
    return {tuple(r.split()[0:3:2]) for r in rows}


def test_03_lists_what_fi_info_lists():
    assert chapter03_pairs() == fi_info_pairs()


@pytest.mark.long
@pytest.mark.parametrize("args,tool_args", [
    (["-p", "shm"], ["-p", "shm"]),
    (["--ep-type", "rdm"], ["-t", "FI_EP_RDM"]),
    (["--caps", "FI_RMA"], ["-c", "FI_RMA"]),
])
def test_03_filters_like_fi_info(args, tool_args):
    assert chapter03_pairs(*args) == fi_info_pairs(*tool_args)


def test_03_verbose_shows_caps_and_mr_mode():
    done = run_chapter(3, "-p", "shm", "-v")
    assert "caps:" in done.stdout and "FI_MSG" in done.stdout and "mr_mode:" in done.stdout


@pytest.mark.parametrize("provider", ["shm", "tcp"])  # the fast tier's run on tcp
def test_04_client_message_reaches_server(provider):
    pair = run_pair(4, provider, client_args=[["ping over " + provider]])
    assert pair.ok, pair
    assert f"received {len('ping over ' + provider)} bytes: ping over {provider}" in pair.server.out
    assert "sent" in pair.clients[0].out
    assert f"-p {provider}" in pair.server.out  # the exact client command is printed


@pytest.mark.long
def test_04_default_provider_is_local_and_said():
    fake_info.skip_where_present("efa", "verbs")
    pair = run_pair(4, None, client_args=[["default"]])
    assert pair.ok, pair
    assert re.search(r"provider: (shm|tcp\S*) \(default: no efa/verbs device here\)",
                     pair.server.out)


def test_05_serves_clients_one_after_another(provider):
    texts = ["hello", "libfabric", "a man a plan"]
    pair = run_pair(5, provider, ["--clients", str(len(texts))], [[t] for t in texts])
    assert pair.ok and not pair.stopped, pair
    for i, (text, client) in enumerate(zip(texts, pair.clients), 1):
        assert f"got back {text[::-1]!r}" in client.out
        assert f"client {i}: {text!r} -> {text[::-1]!r}" in pair.server.out


@pytest.mark.long
def test_05_unicode_round_trip(provider):
    pair = run_pair(5, provider, ["--clients", "1"], [["héllo → 世界"]])
    assert pair.ok, pair
    assert "got back '界世 → olléh'" in pair.clients[0].out
