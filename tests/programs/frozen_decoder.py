"""Chapter 18's decoder as it is, but frozen (SIGSTOP to itself) as it starts to check the
bytes that arrived: the prefiller has sent its timings and waits for the verdict, which
never comes, as from a decoder stopped or frozen at that moment.

    .venv/bin/python tests/programs/frozen_decoder.py ARGS...   (the decoder's arguments)
"""
import os
import signal

from common.chapter_pair import chapter_module

chapter = chapter_module(18)
checking = chapter.check


def frozen(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGSTOP)
    return checking(*args, **kwargs)


chapter.check = frozen
chapter.cli.run(chapter.main)
