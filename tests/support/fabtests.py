"""Whether fabtests' fi_rma_bw, which the baselines run, is here (common/baselines.rma_bw_tool:
bench.tools_prefix()/bin)."""
from common.baselines import rma_bw_tool


def rma_bw_missing():
    """Why the baseline part cannot run here, or None."""
    try:
        rma_bw_tool()
    except FileNotFoundError as e:
        return str(e)
    return None
