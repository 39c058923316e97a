.PHONY: setup lock sbom run test bench kafka-up kafka-down

setup:        ## create .venv and install pinned dependencies
	bash scripts/setup.sh

lock:         ## regenerate requirements*.lock (hashes) from pyproject.toml + constraints.txt with uv
	bash scripts/lock.sh

sbom:         ## CycloneDX SBOM of .venv and the Kafka jars -> var/sbom.cdx.json, checked against the locks
	bash scripts/setup.sh && .venv/bin/weir sbom --out var/sbom.cdx.json --check

run:          ## set up, then start Kafka + gateway + batcher + worker + auditor (Ctrl-C stops all)
	bash scripts/run.sh

test:         ## set up, start Kafka if needed, run the whole test suite
	bash scripts/test.sh

bench:        ## pipeline benchmark: in-process engine vs the full Kafka path
	bash scripts/setup.sh && .venv/bin/weir bench pipeline
