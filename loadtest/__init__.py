"""Load testing for tokengate: seeded workloads, an open-loop streaming runner, compare mode, reports,
plots, shipped scenarios and the noisy-neighbour demo. Talks to gateways and backends only over HTTP."""
