.PHONY: setup run test bench kafka-up kafka-down

setup:        ## create .venv and install pinned dependencies
	bash scripts/setup.sh

run:          ## set up, then start Kafka + gateway + batcher + worker + auditor (Ctrl-C stops all)
	bash scripts/run.sh

test:         ## set up, start Kafka if needed, run the whole test suite
	bash scripts/test.sh

bench:        ## pipeline benchmark: in-process engine vs the full Kafka path
	bash scripts/setup.sh && .venv/bin/weir bench pipeline
