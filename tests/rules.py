"""What the tests of FABRIC_RULES (common/fabric/rules.py) share (tests/test_fabric_rules.py,
tests/test_fabric_efa_direct.py): a client's run, and the words of a rule's error line."""

SMALL = ["--buffer-size", "4M", "--pages", "0-63", "--iters", "3001"]
AV = "rules of efa-direct: a WRITE arrived at an endpoint whose AV has no peer in it"
