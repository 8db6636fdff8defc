"""Load testing: a ghz-compatible RunTask load generator and A/B scheduler comparisons.

- :mod:`switchyard_harness.bench.calldata`: ghz call data (object or array) -> RunTaskRequest.
- :mod:`switchyard_harness.bench.loadgen`: paced server-streaming calls over grpc.aio, in one or several processes.
- :mod:`switchyard_harness.bench.report`: ghz's JSON report plus streaming figures ghz lacks.
- :mod:`switchyard_harness.bench.compare`: scenarios A-D against freshly started in-process stacks.
- :mod:`switchyard_harness.bench.cli`: ``switchyard bench [run|compare|sched]``.
"""
