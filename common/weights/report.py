"""What chapter 19's rank 0 prints after each update, beside the published per-rank
breakdown (results/weight_update_published.json), the clock a trainer keeps of its
stages, and the run's record.
"""
import contextlib
import json
import os
import time

import common.fabric as fi
from common import bench, records

PUBLISHED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "results",
                         "weight_update_published.json")
STAGES = ("edge maxima", "waiting for other ranks", "host-to-device", "quantise",
          "fuse projections", "RDMA submit", "transfer not hidden")  # the published order


class Clock:
    """Seconds spent in each stage, summed over the times it is entered."""

    def __init__(self):
        self.times = dict.fromkeys(STAGES, 0.0)

    @contextlib.contextmanager
    def __call__(self, stage):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[stage] += time.perf_counter() - start


class Report:
    """What rank 0 prints after each update, beside the published breakdown, and the
    run's record."""

    def __init__(self, rank, args, plan, eng, ops, trainers, gpu):
        self.rank, self.args, self.plan, self.eng, self.ops = rank, args, plan, eng, ops
        self.trainers, self.gpu, self.updates, self.failed = trainers, gpu, [], False
        with open(PUBLISHED) as f:
            self.published = json.load(f)["kimi_k2"]

    def update(self, n, naive, results):
        ours, theirs = results[:self.trainers], results[self.trainers:]
        wrong = sum(r["wrong"] for r in theirs)
        changed = sum(r["changed"] for r in theirs)
        expected = sum(r["expected_changed"] for r in theirs)
        self.failed |= wrong > 0 or changed != expected
        seconds = max(r["seconds"] for r in ours)
        entry = {"update": n, "naive": naive, "seconds": seconds, "wrong_bytes": wrong,
                 "tensors_changed": changed, "tensors_expected_changed": expected}
        if not naive:
            entry.update(writes=sum(r["writes"] for r in ours),
                         bytes=sum(r["bytes"] for r in ours),
                         stages=[r["stages"] for r in ours])
            if not self.updates and self.rank == 0:  # the copy ceiling on this path, here
                self.ceiling = self.ops.copy_gbps(min(max(r["bytes"] for r in ours), 1 << 30))
        self.updates.append(entry)
        if self.rank == 0:
            self._print(entry, len(theirs))

    def _print(self, e, inference):
        what = ("every parameter new" if e["update"] == 1 else "a third of the parameters new")
        check = (f"checked on {inference} inference rank{'s' * (inference > 1)}: "
                 f"{e['wrong_bytes']} wrong bytes; {e['tensors_changed']} tensors changed "
                 f"({e['tensors_expected_changed']} expected)")
        if e["naive"]:
            ours = [u["seconds"] for u in self.updates if not u["naive"]][-1]
            print(f"naive (trainer 0 gathers each tensor, quantises it, sends all of it to "
                  f"every inference rank): {e['seconds']:.3f} s, {e['seconds'] / ours:.1f}x "
                  f"the routed update; {check}", flush=True)
            return
        gbps = e["bytes"] / e["seconds"] / 1e9
        print(f"update {e['update']} ({what}): {e['seconds']:.3f} s; {e['bytes'] / 1e9:.3f} GB "
              f"in {e['writes']} WRITEs from {self.trainers} trainers, {gbps:.2f} GB/s (the "
              f"copy ceiling here, one copy of a trainer's bytes: {self.ceiling:.1f} GB/s); "
              f"{check}", flush=True)
        stages = {s: [t[s] * 1e3 for t in e["stages"]] for s in STAGES}
        theirs = self.published["per_rank_ms"]
        print(f"  {'stage, ms':<26}{'median':>9}{'slowest':>9}   Kimi-K2 per rank, published",
              flush=True)
        for ours_name, their_name in zip(STAGES, theirs):
            row = stages[ours_name]
            label = ours_name if ours_name == their_name else f"{ours_name} ({their_name})"
            note = {"host-to-device": "   (weights already where they are quantised)",
                    "fuse projections": "   (offsets in the routing table)"}.get(ours_name, "")
            print(f"  {label:<26}{bench.median(row):>9.1f}{max(row):>9.1f}   "
                  f"{theirs[their_name]:>6}{note}", flush=True)
        per = e["writes"] / self.trainers
        submit = bench.median(stages["RDMA submit"]) / max(per, 1) * 1e3
        print(f"  {'total':<26}{e['seconds'] * 1e3:>9.1f}{'':>9}   "
              f"{self.published['per_rank_total_ms']:>6}; WRITEs per trainer {per:.0f}, "
              f"{submit:.1f} us each to submit (published: {self.published['writes_per_rank']}, "
              f"{self.published['us_per_write']} us)", flush=True)

    def finish(self):
        if self.rank:
            return 0
        print("all checks passed" if not self.failed else "CHECK FAILED: see above", flush=True)
        if self.args.json:
            path = bench.run_path(self.args.json, "19_weight_update", self.args.model,
                                  f"{self.trainers}to{len(self.plan.layouts)}")
            print(f"result: {records.write_json(path, self.record())}", flush=True)
        return 1 if self.failed else 0

    def record(self):
        a = self.args
        return {"chapter": "19_weight_update", "args": records.arguments(),
                "provider": self.eng.provider, "libfabric": "%d.%d" % fi.version(),
                "machine": records.machine(self.gpu), "git": records.git_sha(),
                "memory": "cuda" if a.device == "cuda" else "host", "model": a.model,
                "tensors": len(self.plan.params), "trainers": self.trainers,
                "inference_ranks": len(self.plan.layouts),
                "parameters": sum(p.rows * p.cols for p in self.plan.params),
                "copy_ceiling_gbytes_per_s": self.ceiling, "updates": self.updates}
