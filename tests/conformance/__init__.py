"""One conformance suite for every engine (engines.py lists them; test_contract.py holds the
scenarios)."""
