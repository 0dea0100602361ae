"""The engine of chapters 07-15, each piece moved here by the chapter that taught it.

opqueue (07): the queue of operations a full provider refused, and the server's connection
to a client (heartbeats, inbox, backlog); topo (08): which NICs and cores belong to which
GPU; nics (09): which NICs each user drives, chosen from topo's layout (09-15's lanes, the
MoE proxy, the transfer engine); multinet (09): many NICs per GPU, a lane each, with
flags and report (09): what 09-15 take and print; warmup (10): one WRITE per NIC before the clock, the
engine of 10 and, wrapped around theirs, of 11-15; workers (11): a thread per GPU running its
chapter's C loop; lane.h (11): the lane that loop drives; shards (13): pinned workers, a
counter each.
"""
