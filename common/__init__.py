"""What the chapters share once a chapter has taught it."""
from common import bounds

bounds.quiet_start()  # a Ctrl-C while a program still imports: its exit code and one line
