"""The command line and the engines behind it. `cli` is the parser and the run of a command; `commands/` holds each
command's flags, checks and body (bench and lat, perftest's server mode, the collectives, the peers' commands, the
one-host ones) with perftest's flags (`perftest_flags`) and the shared argument types (`arguments`). The engines:
bench's (`perftest`: its options `bench_config`, QP pairs `bench_flows`, checks `bench_verify`, table
`bench_report`) and lat's (`latency`: `lat_config`, `lat_report`) on one shared options type (`options`), with what
their runs share (`runs`, `sweeps`, `introspect`: the emulator's debug channel) and their helpers (samples, units,
plots, signals). Nothing below imports this package."""
