"""The model on cases with known answers, its calibration against the blog, and its scripts."""
import json
import math
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from common.model import calibration, journey
from common.model.p5 import Costs, Layout, Machine, throughput, wire_us

ROOT = Path(__file__).resolve().parents[1]
PAGE = 64 << 10
FAST_LINK = Machine(gpus=8, nics_per_gpu=4, link_gbps=1e6)  # never the limit


def close(a, b, rel=1e-6):
    return math.isclose(a, b, rel_tol=rel)


def test_one_nic_without_cpu_cost_runs_at_the_link():
    nic = Machine(gpus=1, nics_per_gpu=1, link_gbps=100, efficiency=0.9)
    result = throughput(nic, Costs(), Layout())
    assert close(result.gbps, 90) and result.limit == "link" and close(result.percent, 90)


def test_links_add_up():
    p5 = Machine(gpus=8, nics_per_gpu=4, link_gbps=100)
    assert close(throughput(p5, Costs(), Layout(threads_per_gpu=1)).gbps, 3200)


@pytest.mark.parametrize("nics_per_gpu", [1, 4])
def test_one_thread_does_one_write_per_post_and_visit(nics_per_gpu):
    costs = Costs(post_us=0.5, visit_us=1.5)
    result = throughput(FAST_LINK, costs, Layout(nics_per_gpu=nics_per_gpu))
    assert close(result.mpps, 1 / 2.0) and result.limit == "cpu"


def test_threads_multiply_and_batches_share_the_visit():
    costs = Costs(post_us=0.5, visit_us=1.5)
    assert close(throughput(FAST_LINK, costs, Layout(threads_per_gpu=1)).mpps, 8 / 2.0)
    batched = throughput(FAST_LINK, costs, Layout(threads_per_gpu=1, batch=16))
    assert close(batched.mpps, 8 / (0.5 + 1.5 / 16))
    assert close(batched.per_visit, 16)


def test_crowding_and_unpinned_threads_slow_each_one():
    two_nodes = replace(FAST_LINK, numa_nodes=2)  # 4 threads per node
    costs = Costs(post_us=1, visit_us=1, crowd=0.25, unpinned=3)
    pinned = throughput(two_nodes, costs, Layout(threads_per_gpu=1))
    assert close(pinned.mpps, 8 / (2 * (1 + 0.25 * 3)))
    unpinned = throughput(two_nodes, costs, Layout(threads_per_gpu=1, pinned=False))
    assert close(unpinned.mpps, pinned.mpps / 3)


def test_a_shared_counter_serves_one_update_at_a_time():
    costs = Costs(post_us=0.1, visit_us=0.1, atomic_us=0.5)
    shared = throughput(FAST_LINK, costs, Layout(threads_per_gpu=1, shared_counter=True))
    assert close(shared.mpps, 1 / 0.5) and shared.limit == "shared counter"
    alone = throughput(FAST_LINK, costs, Layout(shared_counter=True))  # one thread: no contention
    assert close(alone.mpps, 1 / 0.2)


def test_queue_limit_is_littles_law():
    nic = Machine(gpus=1, nics_per_gpu=1, link_gbps=100, inflight=2, latency_us=10)
    result = throughput(nic, Costs(), Layout())
    per_us = 2 / (wire_us(nic, PAGE) + 10)
    assert close(result.mpps, per_us) and result.limit == "queue"


def test_lazy_posting_refills_a_round_sooner():
    nic = Machine(gpus=1, nics_per_gpu=1, link_gbps=100, inflight=2, latency_us=10)
    costs = Costs(visit_us=4)  # a round of one NIC is one visit: 4 us
    held = wire_us(nic, PAGE) + 10
    eager = throughput(nic, costs, Layout(batch=64))
    lazy = throughput(nic, costs, Layout(batch=64, lazy=True))
    assert close(eager.mpps, 2 / (held + 1.5 * 4)) and close(lazy.mpps, 2 / (held + 0.5 * 4))


def test_cold_nics_cost_their_first_contact_once_each():
    nic = Machine(gpus=1, nics_per_gpu=4, link_gbps=100)
    layout = Layout(warmup=False, ops=1_000_000)
    result = throughput(nic, Costs(first_contact_ms=20), layout)
    steady = layout.ops * 8 * PAGE / 400e9
    assert close(result.gbps, layout.ops * 8 * PAGE / (steady + 4 * 0.020) / 1e9)


@pytest.fixture(scope="module")
def fresh():
    return calibration.calibrate(calibration.load_blog(), calibration.measured())


@pytest.fixture(scope="module")
def crowd_fitted():
    return calibration.calibrate_fitting_crowd(calibration.load_blog(), calibration.measured())


# The predictions that miss the tolerance, with their error in percent, as notebooks/README.md's
# "The model" reports them: the test holds them to that figure, not to the tolerance they miss.
MISSES = {"09": +61.5, "10": +60.7, "12": +25.7, "13": +13.4}
CROWD_FITTED_MISSES = {"09": +61.5, "10": +60.7, "12": +12.2}  # its other choice


def check_errors(result, misses, fitted):
    blog = calibration.load_blog()["chapters"]
    rows = {r["chapter"]: r for r in result["chapters"]}
    assert set(rows) == set(blog) and result["tolerance_percent"] == 10
    for chapter, row in rows.items():
        error = 100 * (row["model_gbps"] / blog[chapter]["gbps"] - 1)
        if row["role"] == "fitted":
            assert abs(error) <= 0.1, row
        elif chapter in misses:
            reported = misses[chapter]
            assert abs(error) > result["tolerance_percent"], row
            assert row["error_percent"] == reported and abs(error - reported) < 0.1, row
        else:
            assert abs(error) <= result["tolerance_percent"], row
    assert [r["chapter"] for r in rows.values() if r["role"] == "fitted"] == fitted
    assert sum(r["role"] == "predicted" for r in rows.values()) == len(rows) - len(fitted)


def test_predictions_are_within_the_stated_tolerance_or_the_stated_miss(fresh):
    check_errors(fresh, MISSES, ["11", "14"])


def test_crowd_fitted_instead_gives_the_other_table(crowd_fitted):
    check_errors(crowd_fitted, CROWD_FITTED_MISSES, ["11", "13", "14"])
    assert crowd_fitted["parameters"]["crowd"]["source"] == "fitted on 13"


@pytest.mark.parametrize("name", ["fresh", "crowd_fitted"])
def test_every_parameter_says_where_it_comes_from(name, request):
    result = request.getfixturevalue(name)
    fitted = 0
    for key, p in result["parameters"].items():
        assert p["unit"] and p["meaning"], key
        kind, _, rest = p["source"].partition(" ")
        if kind == "measured:":  # the files it was measured in, each there
            files = re.findall(r"results/[\w./-]+\.json", rest)
            assert files and all((ROOT / f).is_file() for f in files), p
        elif kind == "fitted":
            fitted += 1
            assert rest.split()[-1] in calibration.CHAPTERS, p
        else:
            assert p["source"] in ("blog", "assumed"), p
    assert fitted <= 3
    assert fitted == sum(r["role"] == "fitted" for r in result["chapters"])


def test_no_more_than_three_fits_and_none_of_a_measured_parameter():
    blog, ours = calibration.load_blog(), calibration.measured()
    with pytest.raises(ValueError, match="measured too: crowd"):
        calibration.calibrate(blog, ours, fits=[calibration.CROWD_FIT, *calibration.FITS])
    four = [calibration.CROWD_FIT, *calibration.FITS, ("atomic_us", "12", (0, 1))]
    with pytest.raises(ValueError, match="4 fits"):
        calibration.calibrate(blog, {}, fits=four)


def test_the_ladder_meets_the_aim_only_at_five_fits():
    """notebooks/README.md's "where it ends": the measured costs fitted instead, one chapter
    more each time. Within 10% everywhere takes five of the eight figures as inputs."""
    blog = calibration.load_blog()["chapters"]
    errors = [{r["chapter"]: (r["error_percent"], r["role"]) for r in rung["chapters"]}
              for rung in calibration.ladder(calibration.load_blog(), calibration.measured())]
    # op_us from 10: 09 comes right, but with our crowding the p5's threads are CPU-bound
    # below every later figure, 14 (fitted) included
    assert errors[0]["09"] == (1.2, "predicted") and errors[0]["14"] == (-21.9, "fitted")
    assert [errors[0][c][0] for c in ("12", "13", "15")] == [-18.7, -29.4, -34.9]
    assert errors[1]["12"] == (12.2, "predicted")  # crowd from 13 too: 12 alone misses
    for rung, misses in zip(errors, [{"12", "13", "14", "15"}, {"12"}, set()]):
        assert {c for c, (e, _) in rung.items() if abs(e) > 10} == misses
        assert set(rung) == set(blog)
    assert sorted(c for c, (_, role) in errors[2].items() if role == "predicted") == \
        ["07", "09", "15"]


def write_chapter13(folder, name, groups, mpps):
    run = {"tool": "chapter 13", "size": 4096, "mpps": mpps,
           "command": f"--pages 0-63 --groups {groups}"}
    other = {"tool": "chapter 13", "size": 65536, "mpps": 0.01, "command": f"--groups {groups}"}
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps({"runs": [other, run]}))


def test_measured_costs_are_read_from_their_files(tmp_path):
    atomic = {"runs": [{"threads": t, "turns_ns": 10.0 * t} for t in (1, 2, 4, 16)]}
    (tmp_path / calibration.ATOMIC).parent.mkdir(parents=True)
    (tmp_path / calibration.ATOMIC).write_text(json.dumps(atomic))
    write_chapter13(tmp_path, calibration.ALONE, 1, 0.5)    # 2 us per WRITE
    write_chapter13(tmp_path, calibration.CROWDED, 4, 1.0)  # 4 us each: 1 + 3 x 1/3
    ours = calibration.measured(tmp_path)
    assert close(ours["atomic_us"][0], 0.040) and "4 threads in turns" in ours["atomic_us"][1]
    assert close(ours["op_us"][0], 2.0) and calibration.ALONE in ours["op_us"][1]
    assert close(ours["crowd"][0], 1 / 3)
    assert calibration.CROWDED in ours["crowd"][1] and calibration.ALONE in ours["crowd"][1]


def test_measured_costs_on_the_h200_box():
    """The values notebooks/README.md states, from the files committed."""
    ours = calibration.measured()
    assert round(ours["op_us"][0], 2) == 1.11 and round(ours["crowd"][0], 3) == 0.395
    assert round(ours["atomic_us"][0], 3) == 0.266 and "8 threads" in ours["atomic_us"][1]


def test_committed_calibration_is_current(fresh):
    committed = json.loads((ROOT / "results" / "model" / "calibration.json").read_text())
    assert committed == json.loads(json.dumps(fresh)), "run scripts/calibrate.py"


def test_the_calibrated_p5_gives_back_its_table(fresh):
    machine, costs = calibration.p5(fresh)
    for row in fresh["chapters"]:
        gbps = throughput(machine, costs, calibration.CHAPTERS[row["chapter"]][1]).gbps
        assert abs(gbps - row["model_gbps"]) < 0.5


def write_results(folder):
    """A results tree: the blog, one setup of ours with chapter 07, its baselines, junk."""
    shutil.copy(ROOT / "results" / "blog_p5.json", folder)
    (folder / "07_queue").mkdir()
    (folder / "baselines").mkdir()
    run = {"tool": "chapter 07", "size": PAGE, "median_gbps": 30.0}
    (folder / "07_queue" / "box-shm-host.json").write_text(json.dumps({"runs": [run]}))
    base = [{"tool": "fi_rma_bw -o write", "size": PAGE, "median_gbps": 40.0},
            {"tool": "fi_rma_bw -o writedata", "size": PAGE, "median_gbps": 60.0},
            {"tool": "fi_rma_bw -o writedata", "size": 2 * PAGE, "median_gbps": 90.0}]
    (folder / "baselines" / "box-shm-host.json").write_text(json.dumps({"runs": base}))
    (folder / "07_queue" / "broken.json").write_text("{")


def test_ours_are_shares_of_the_best_baseline_of_their_setup(tmp_path):
    write_results(tmp_path)
    ours = journey.measured(tmp_path)
    assert list(ours) == ["box-shm-host"]
    figure = ours["box-shm-host"]["chapters"]["07"]
    assert figure["limit"] == "fi_rma_bw -o writedata" and close(figure["percent"], 50)


MEASUREMENTS = (calibration.ATOMIC, calibration.ALONE, calibration.CROWDED)


def write_measurements(folder):
    """The files the calibration reads our measured costs from."""
    for name in MEASUREMENTS:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "results" / name, folder / name)


def script(name, *args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args],
                          capture_output=True, text=True, timeout=120)


def test_journey_script_draws_from_any_results_folder(tmp_path):
    write_results(tmp_path)
    write_measurements(tmp_path)
    done = script("journey.py", "--results", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "journey.png").stat().st_size > 10_000


def test_calibrate_script_writes_and_prints_the_table(tmp_path, fresh):
    write_results(tmp_path)
    write_measurements(tmp_path)
    done = script("calibrate.py", "--results", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "model" / "calibration.json").read_text()) == \
        json.loads(json.dumps(fresh))
    assert calibration.table(fresh) in done.stdout


def test_calibrate_script_prints_the_other_choice_and_writes_nothing(tmp_path, crowd_fitted):
    write_results(tmp_path)
    write_measurements(tmp_path)
    done = script("calibrate.py", "--results", str(tmp_path), "--fit-crowd")
    assert done.returncode == 0, done.stderr
    assert calibration.table(crowd_fitted) in done.stdout
    assert not (tmp_path / "model" / "calibration.json").exists()


def test_scripts_reject_a_measurement_of_the_wrong_run(tmp_path):
    write_results(tmp_path)
    write_measurements(tmp_path)
    write_chapter13(tmp_path, calibration.ALONE, 2, 1.0)
    for name in ("calibrate.py", "journey.py"):
        done = script(name, "--results", str(tmp_path))
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1 and "not 1" in lines[0], done.stderr


@pytest.mark.parametrize("blog,pattern", [
    (None, "cannot read"),
    ("{", "is not JSON"),
    ('{"chapters": {}}', "lacks"),
])
def test_scripts_reject_bad_results_in_one_line(tmp_path, blog, pattern):
    if blog is not None:
        (tmp_path / "blog_p5.json").write_text(blog)
    for name in ("calibrate.py", "journey.py"):
        done = script(name, "--results", str(tmp_path))
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1 and pattern in lines[0], done.stderr


def test_scripts_say_which_measurement_is_missing(tmp_path):
    write_results(tmp_path)  # the blog's figures, none of our measured costs
    for name in ("calibrate.py", "journey.py"):
        done = script(name, "--results", str(tmp_path))
        assert done.returncode == 1 and f"cannot read {tmp_path / calibration.ATOMIC}:" in done.stderr


def test_readme_table_is_the_calibration(fresh, crowd_fitted):
    """notebooks/README.md's table of the model is a copy: it must say what calibrate() says,
    and in its last three columns what the other choice (crowd fitted on 13) says."""
    readme = (ROOT / "notebooks" / "README.md").read_text()
    for row, other in zip(fresh["chapters"], crowd_fitted["chapters"]):
        cells = next(line for line in readme.splitlines()
                     if line.startswith(f"| {row['chapter']} | {row['blog_gbps']:.1f} |")).split("|")
        for first, r in ((3, row), (7, other)):
            assert float(cells[first]) == r["model_gbps"], cells
            assert cells[first + 2].strip() == r["role"], cells
            if r["role"] == "predicted":
                assert float(cells[first + 1].strip().rstrip("%")) == r["error_percent"], cells


def test_nics_must_split_evenly_among_threads():
    with pytest.raises(ValueError, match="split evenly"):
        throughput(FAST_LINK, Costs(), Layout(threads_per_gpu=3))


def test_atomic_bench_wants_a_core_per_thread():
    done = script("atomic_bench.py", "--label", "test", "--threads", "1,100000")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "one core each" in lines[0], done.stderr


@pytest.mark.parametrize("name,args", [("atomic_bench.py", ()),
                                       ("progression.py", ("-p", "shm"))])
def test_a_label_is_a_name_not_a_path(name, args):
    # the label becomes part of a file name under results/: a path there would write
    # outside it (or fail at the end, after the measurement)
    done = script(name, "--label", "../elsewhere", *args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and "plain name" in lines[-1], done.stderr
    assert "Traceback" not in done.stderr


# --- the EFA instances of 2026 (common/model/instances.py) -----------------------------------

def test_each_instance_is_the_calibrated_p5_with_its_own_nics():
    from common.model import instances
    blog = calibration.load_blog()
    p5, costs = calibration.p5(calibration.calibrate(blog, calibration.measured()))
    assert instances.machine(p5, instances.INSTANCES["p5"]) == p5
    shapes = {k: (i.nics, i.line_gbps) for k, i in instances.INSTANCES.items()}
    assert shapes == {"p5": (32, 3200), "p5en": (16, 3200), "p6-b200": (8, 3200),
                      "p6-b300": (16, 6400)}
    published = json.loads((calibration.RESULTS / "mooncake_published.json").read_text())
    rows = {r["instance"]: r for r in instances.table(p5, costs, published["instances"])}
    # chapter 15 on the p5 is the calibrated model's chapter 15
    assert rows["p5"]["chapter15_gbps"] == round(
        throughput(p5, costs, calibration.CHAPTERS["15"][1]).gbps, 1)
    # 1 MiB WRITEs are link-bound everywhere: twice the NICs' total, twice the figure
    assert {r["transfer_limit"] for r in rows.values()} == {"link"}
    assert rows["p6-b300"]["transfer_gbps"] == pytest.approx(2 * rows["p5"]["transfer_gbps"],
                                                             rel=1e-3)
    # a NIC four times as fast drains the fitted places four times as fast (chapter 15)
    assert rows["p6-b200"]["chapter15_limit"] == "queue"
    assert rows["p6-b200"]["mooncake_lower_bound"] and rows["p5"]["mooncake_gbps"] == 3111.2
