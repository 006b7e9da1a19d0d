"""One model across processes: communication among ranks (issue 18)."""
