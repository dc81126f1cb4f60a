"""What a finished fleet run says: report.json and report.md, plots, the pooled-data ceiling, contributions, ledgers, audits."""
