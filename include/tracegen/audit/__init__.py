"""From ledger rows to decisions: statistics, the cap fit, the gate, and the rendered report."""
