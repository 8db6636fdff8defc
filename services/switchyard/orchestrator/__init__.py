"""The orchestrator: ``agent.AgentService``, each task's workflow of CPU stages, retrieval and model calls.

Modules, in the order a task meets them (each module's docstring says what it owns and what it hands to whom):

- :mod:`.service`: ``OrchestratorService`` (RunTask, SubmitTask, GetTaskStatus, CancelTask): validates, runs
  the task's workflow inside its deadline, streams its events; :mod:`.http_face`: the same calls as JSON and
  Server-Sent Events, through the servicer (its shapes and OpenAPI document: :mod:`.http_models`; its listener
  over TLS, which answers plain HTTP 400: :mod:`.https_listener`).
- :mod:`.validation`: a request checked at the edge, before ``accepted`` (its fields against ``limits``, the
  x-agent-id and x-priority headers, the tenant).
- :mod:`.submitted`: the SubmitTask tasks one orchestrator holds, its backlog; :mod:`.taskstore`: their
  durable records (SQLite or Redis), read by GetTaskStatus on any replica.
- :mod:`.task`: one task's state while its workflow runs (events, stages, CPU work); :mod:`.events`: its
  events on their way to the caller.
- :mod:`.workflows`: one async function per task type; :mod:`.react`: react_loop's think -> tool -> observe
  loop, with :mod:`.tools`; :mod:`.prompts` and :mod:`.tokens`: prompt rendering and token counting;
  :mod:`.agent_memory`: an agent's memory across its tasks; :mod:`.program`: what is measured of a task's
  program, and the deadline rule it is budgeted by.
- :mod:`.clients`: the retrieval and dispatcher clients; :mod:`.generate_stream`: many model calls over one
  GenerateStream per dispatcher channel; :mod:`.replicas`: which dispatcher replica an agent's call goes to.
- :mod:`.addresses`: what a caller reads of an error leaving either face, internal addresses hidden.
- :mod:`.readiness`: SERVING only while the services a task needs answer; :mod:`.metrics`: its Prometheus
  metrics.
"""
