"""The EFA instances of 2026 in the model: the p5 the model is calibrated on, and the
p5en, p6-b200 and p6-b300, each the p5's Machine with its own NICs.

What changes from one instance to the next is the NICs alone (how many a GPU has, how fast
each is); the rest is the p5's as calibrated (calibration.py): the CPU costs measured on
our H200 box, the link efficiency from the p5's fabtests, the WRITEs a NIC holds in flight
fitted on chapter 14, the assumed latency. Those are the assumptions each prediction
carries (notebooks/instances.ipynb says which matter where).

Two engines are predicted on each:
- chapter 15's (a pinned thread per GPU, up to 16 WRITEs per NIC per visit, lazy posting,
  64 KiB WRITEs), as calibration.CHAPTERS lays it out;
- the transfer engine's (common/transfer: one worker thread per GPU over that GPU's NICs,
  filling each NIC's free places at every visit, no FI_MORE), at 1 MiB WRITEs: the size of
  Mooncake's published table (results/mooncake_published.json).
"""
from dataclasses import dataclass, replace

from common.model.calibration import CHAPTERS
from common.model.p5 import Layout, throughput


@dataclass(frozen=True)
class Instance:
    name: str          # AWS's name
    nics_per_gpu: int
    link_gbps: float   # one NIC's link speed
    gpus: int = 8

    @property
    def nics(self):
        return self.gpus * self.nics_per_gpu

    @property
    def line_gbps(self):
        return self.nics * self.link_gbps


# AWS's instance pages: NICs and their speeds (a p5e has the p5's NICs).
INSTANCES = {"p5": Instance("p5.48xlarge", 4, 100), "p5en": Instance("p5en.48xlarge", 2, 200),
             "p6-b200": Instance("p6-b200.48xlarge", 1, 400),
             "p6-b300": Instance("p6-b300.48xlarge", 2, 400)}

CHAPTER_15 = CHAPTERS["15"][1]
# The transfer engine at Mooncake's block size: a worker per GPU, lazy (a freed place is
# refilled at once), as many WRITEs a visit as a NIC has free places.
TRANSFER = Layout(threads_per_gpu=1, batch=1024, lazy=True, page=1 << 20, ops=1_000_000)


def machine(p5, instance):
    """The calibrated p5 Machine with `instance`'s NICs."""
    return replace(p5, gpus=instance.gpus, nics_per_gpu=instance.nics_per_gpu,
                   link_gbps=instance.link_gbps)


def predict(p5, costs, layout, instance):
    """The model's Result for `layout` on `instance` (calibrated `p5`, `costs`)."""
    return throughput(machine(p5, instance), costs, layout)


def table(p5, costs, published):
    """Per instance: its line rate, chapter 15's and the transfer engine's predictions with
    what binds them, and Mooncake's published figure (Gbps; `published`: the JSON's
    "instances"), with the model's distance from it."""
    rows = []
    for key, instance in INSTANCES.items():
        ch15 = predict(p5, costs, CHAPTER_15, instance)
        engine = predict(p5, costs, TRANSFER, instance)
        theirs = published.get(key, {})
        gbps = theirs.get("gbps_per_node")
        rows.append({"instance": key, "nics": f"{instance.nics} x {instance.link_gbps:g}",
                     "line_gbps": instance.line_gbps,
                     "chapter15_gbps": round(ch15.gbps, 1), "chapter15_limit": ch15.limit,
                     "transfer_gbps": round(engine.gbps, 1), "transfer_limit": engine.limit,
                     "mooncake_gbps": gbps, "mooncake_lower_bound": theirs.get("lower_bound", False),
                     "model_vs_mooncake_percent": round(100 * (engine.gbps / gbps - 1), 1)
                     if gbps else None})
    return rows
