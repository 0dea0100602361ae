"""One colour for one thing in every plot: who measured a figure, and with which tool.

Who: the blog's p5 (black), the model of it (red), our committed runs (blue), the
reader's own runs from results/runs/ (green). Tools measured beside a chapter, in the
same run, have a colour each; a chapter's own figure takes its measurer's colour.
Setups of ours are told apart by marker and line style, not colour (SETUP_STYLES).
"""
BLOG = "black"
MODEL = "tab:red"
OURS = "tab:blue"
YOURS = "tab:green"
LINE_RATE = "grey"   # a link speed: a ceiling drawn as a dashed line
TOOLS = {            # by the start of a tool's name in results/
    "fi_rma_bw -o writedata": "tab:brown",
    "fi_rma_bw": "tab:orange",
    "ucx_perftest": "tab:purple",
    "cudaMemcpyPeer both ways": "tab:pink",
    "cudaMemcpyPeer": "tab:gray",
    "nccl": "tab:olive",
    "nixl": "tab:cyan",
    "gather kernel": "goldenrod",  # the same GPU gathering the same pages (a ceiling)
}
SETUP_STYLES = [("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."), ("v", "-"), ("P", "--")]


def tool(name, chapter_colour=OURS):
    """The colour of a tool by its name; a chapter ("chapter 09 (4 NICs)") gets its measurer's."""
    for prefix, colour in TOOLS.items():
        if name.lower().startswith(prefix.lower()):
            return colour
    return chapter_colour
