from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_UNSPECIFIED: _ClassVar[Priority]
    CORE: _ClassVar[Priority]
    NORMAL: _ClassVar[Priority]
    BATCH: _ClassVar[Priority]

class TaskState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_STATE_UNSPECIFIED: _ClassVar[TaskState]
    QUEUED: _ClassVar[TaskState]
    RUNNING: _ClassVar[TaskState]
    SUCCEEDED: _ClassVar[TaskState]
    FAILED: _ClassVar[TaskState]

class FlushReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FLUSH_REASON_UNSPECIFIED: _ClassVar[FlushReason]
    SIZE: _ClassVar[FlushReason]
    INTERVAL: _ClassVar[FlushReason]
    DRAIN: _ClassVar[FlushReason]
    IDLE: _ClassVar[FlushReason]
    STEP: _ClassVar[FlushReason]
    PREEMPT: _ClassVar[FlushReason]

class ToolWaitDecision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_WAIT_DECISION_UNSPECIFIED: _ClassVar[ToolWaitDecision]
    KEEP: _ClassVar[ToolWaitDecision]
    SWAP: _ClassVar[ToolWaitDecision]
    DROP: _ClassVar[ToolWaitDecision]
PRIORITY_UNSPECIFIED: Priority
CORE: Priority
NORMAL: Priority
BATCH: Priority
TASK_STATE_UNSPECIFIED: TaskState
QUEUED: TaskState
RUNNING: TaskState
SUCCEEDED: TaskState
FAILED: TaskState
FLUSH_REASON_UNSPECIFIED: FlushReason
SIZE: FlushReason
INTERVAL: FlushReason
DRAIN: FlushReason
IDLE: FlushReason
STEP: FlushReason
PREEMPT: FlushReason
TOOL_WAIT_DECISION_UNSPECIFIED: ToolWaitDecision
KEEP: ToolWaitDecision
SWAP: ToolWaitDecision
DROP: ToolWaitDecision

class TokenUsage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_wait_s", "ttft_s", "total_s", "stage_s")
    class QueueWaitSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class StageSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    QUEUE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    STAGE_S_FIELD_NUMBER: _ClassVar[int]
    queue_wait_s: _containers.ScalarMap[str, float]
    ttft_s: float
    total_s: float
    stage_s: _containers.ScalarMap[str, float]
    def __init__(self, queue_wait_s: _Optional[_Mapping[str, float]] = ..., ttft_s: _Optional[float] = ..., total_s: _Optional[float] = ..., stage_s: _Optional[_Mapping[str, float]] = ...) -> None: ...

class RunTaskRequest(_message.Message):
    __slots__ = ("task_id", "payload", "agent_id", "priority", "task_type", "max_tokens", "model", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TASK_TYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    payload: str
    agent_id: str
    priority: Priority
    task_type: str
    max_tokens: int
    model: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, task_id: _Optional[str] = ..., payload: _Optional[str] = ..., agent_id: _Optional[str] = ..., priority: _Optional[_Union[Priority, str]] = ..., task_type: _Optional[str] = ..., max_tokens: _Optional[int] = ..., model: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Accepted(_message.Message):
    __slots__ = ("task_id", "queue_position", "trace_id", "state")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    queue_position: int
    trace_id: str
    state: TaskState
    def __init__(self, task_id: _Optional[str] = ..., queue_position: _Optional[int] = ..., trace_id: _Optional[str] = ..., state: _Optional[_Union[TaskState, str]] = ...) -> None: ...

class StageEvent(_message.Message):
    __slots__ = ("name", "start_s", "end_s", "duration_s", "attributes")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    START_S_FIELD_NUMBER: _ClassVar[int]
    END_S_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    start_s: float
    end_s: float
    duration_s: float
    attributes: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., start_s: _Optional[float] = ..., end_s: _Optional[float] = ..., duration_s: _Optional[float] = ..., attributes: _Optional[_Mapping[str, str]] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("text", "index", "count")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    text: str
    index: int
    count: int
    def __init__(self, text: _Optional[str] = ..., index: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class ToolCallEvent(_message.Message):
    __slots__ = ("call_id", "name", "arguments_json")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    name: str
    arguments_json: str
    def __init__(self, call_id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class ToolResultEvent(_message.Message):
    __slots__ = ("call_id", "name", "content", "is_error", "attempts")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    IS_ERROR_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    name: str
    content: str
    is_error: bool
    attempts: int
    def __init__(self, call_id: _Optional[str] = ..., name: _Optional[str] = ..., content: _Optional[str] = ..., is_error: _Optional[bool] = ..., attempts: _Optional[int] = ...) -> None: ...

class FinalEvent(_message.Message):
    __slots__ = ("task_id", "output", "usage", "timings", "compute_score_used", "memory_peak_bytes", "trace_id", "model", "passages", "finish_reason")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SCORE_USED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PASSAGES_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    output: str
    usage: TokenUsage
    timings: Timings
    compute_score_used: float
    memory_peak_bytes: int
    trace_id: str
    model: str
    passages: _containers.RepeatedCompositeFieldContainer[Passage]
    finish_reason: str
    def __init__(self, task_id: _Optional[str] = ..., output: _Optional[str] = ..., usage: _Optional[_Union[TokenUsage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., compute_score_used: _Optional[float] = ..., memory_peak_bytes: _Optional[int] = ..., trace_id: _Optional[str] = ..., model: _Optional[str] = ..., passages: _Optional[_Iterable[_Union[Passage, _Mapping]]] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class TaskEvent(_message.Message):
    __slots__ = ("accepted", "stage", "token", "tool_call", "tool_result", "final")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    TOOL_RESULT_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    accepted: Accepted
    stage: StageEvent
    token: TokenEvent
    tool_call: ToolCallEvent
    tool_result: ToolResultEvent
    final: FinalEvent
    def __init__(self, accepted: _Optional[_Union[Accepted, _Mapping]] = ..., stage: _Optional[_Union[StageEvent, _Mapping]] = ..., token: _Optional[_Union[TokenEvent, _Mapping]] = ..., tool_call: _Optional[_Union[ToolCallEvent, _Mapping]] = ..., tool_result: _Optional[_Union[ToolResultEvent, _Mapping]] = ..., final: _Optional[_Union[FinalEvent, _Mapping]] = ...) -> None: ...

class GetTaskStatusRequest(_message.Message):
    __slots__ = ("task_id", "agent_id")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    agent_id: str
    def __init__(self, task_id: _Optional[str] = ..., agent_id: _Optional[str] = ...) -> None: ...

class TaskStatus(_message.Message):
    __slots__ = ("task_id", "state", "result", "error", "compute_score_used", "memory_peak_bytes", "timings", "tenant_id", "queue_position")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SCORE_USED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    state: TaskState
    result: FinalEvent
    error: str
    compute_score_used: float
    memory_peak_bytes: int
    timings: Timings
    tenant_id: str
    queue_position: int
    def __init__(self, task_id: _Optional[str] = ..., state: _Optional[_Union[TaskState, str]] = ..., result: _Optional[_Union[FinalEvent, _Mapping]] = ..., error: _Optional[str] = ..., compute_score_used: _Optional[float] = ..., memory_peak_bytes: _Optional[int] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., tenant_id: _Optional[str] = ..., queue_position: _Optional[int] = ...) -> None: ...

class CancelTaskRequest(_message.Message):
    __slots__ = ("task_id",)
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    def __init__(self, task_id: _Optional[str] = ...) -> None: ...

class RetrieveRequest(_message.Message):
    __slots__ = ("query", "top_k")
    QUERY_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    query: str
    top_k: int
    def __init__(self, query: _Optional[str] = ..., top_k: _Optional[int] = ...) -> None: ...

class Passage(_message.Message):
    __slots__ = ("text", "score", "source", "title")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    text: str
    score: float
    source: str
    title: str
    def __init__(self, text: _Optional[str] = ..., score: _Optional[float] = ..., source: _Optional[str] = ..., title: _Optional[str] = ...) -> None: ...

class RetrieveResponse(_message.Message):
    __slots__ = ("passages", "queue_wait_s", "embed_s", "search_s")
    PASSAGES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    EMBED_S_FIELD_NUMBER: _ClassVar[int]
    SEARCH_S_FIELD_NUMBER: _ClassVar[int]
    passages: _containers.RepeatedCompositeFieldContainer[Passage]
    queue_wait_s: float
    embed_s: float
    search_s: float
    def __init__(self, passages: _Optional[_Iterable[_Union[Passage, _Mapping]]] = ..., queue_wait_s: _Optional[float] = ..., embed_s: _Optional[float] = ..., search_s: _Optional[float] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_call_id", "name", "tool_calls")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_call_id: str
    name: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class ToolSpec(_message.Message):
    __slots__ = ("name", "description", "parameters_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "messages", "prompt_tokens", "max_tokens", "model", "priority", "task_type", "agent_id", "tools", "resume", "tenant_id", "task_time_left_s", "expected_remaining_work_s", "prefill_only", "task_id", "no_early_refusal", "early_refusal_margin_s", "deadline_source")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TASK_TYPE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_TIME_LEFT_S_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_REMAINING_WORK_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ONLY_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    NO_EARLY_REFUSAL_FIELD_NUMBER: _ClassVar[int]
    EARLY_REFUSAL_MARGIN_S_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    prompt_tokens: int
    max_tokens: int
    model: str
    priority: Priority
    task_type: str
    agent_id: str
    tools: _containers.RepeatedCompositeFieldContainer[ToolSpec]
    resume: bool
    tenant_id: str
    task_time_left_s: float
    expected_remaining_work_s: float
    prefill_only: bool
    task_id: str
    no_early_refusal: bool
    early_refusal_margin_s: float
    deadline_source: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., model: _Optional[str] = ..., priority: _Optional[_Union[Priority, str]] = ..., task_type: _Optional[str] = ..., agent_id: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[ToolSpec, _Mapping]]] = ..., resume: _Optional[bool] = ..., tenant_id: _Optional[str] = ..., task_time_left_s: _Optional[float] = ..., expected_remaining_work_s: _Optional[float] = ..., prefill_only: _Optional[bool] = ..., task_id: _Optional[str] = ..., no_early_refusal: _Optional[bool] = ..., early_refusal_margin_s: _Optional[float] = ..., deadline_source: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("call_id", "name", "arguments_json")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    name: str
    arguments_json: str
    def __init__(self, call_id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token", "tool_call", "done")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    token: TokenEvent
    tool_call: ToolCall
    done: GenerateDone
    def __init__(self, token: _Optional[_Union[TokenEvent, _Mapping]] = ..., tool_call: _Optional[_Union[ToolCall, _Mapping]] = ..., done: _Optional[_Union[GenerateDone, _Mapping]] = ...) -> None: ...

class GenerateDone(_message.Message):
    __slots__ = ("usage", "queue_wait_s", "ttft_s", "compute_score_used", "memory_peak_bytes", "batch_size", "flush_reason", "model", "preemptions", "finish_reason", "prompt_token_ratio", "waited_on")
    USAGE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SCORE_USED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    FLUSH_REASON_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_RATIO_FIELD_NUMBER: _ClassVar[int]
    WAITED_ON_FIELD_NUMBER: _ClassVar[int]
    usage: TokenUsage
    queue_wait_s: float
    ttft_s: float
    compute_score_used: float
    memory_peak_bytes: int
    batch_size: int
    flush_reason: FlushReason
    model: str
    preemptions: int
    finish_reason: str
    prompt_token_ratio: float
    waited_on: str
    def __init__(self, usage: _Optional[_Union[TokenUsage, _Mapping]] = ..., queue_wait_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., compute_score_used: _Optional[float] = ..., memory_peak_bytes: _Optional[int] = ..., batch_size: _Optional[int] = ..., flush_reason: _Optional[_Union[FlushReason, str]] = ..., model: _Optional[str] = ..., preemptions: _Optional[int] = ..., finish_reason: _Optional[str] = ..., prompt_token_ratio: _Optional[float] = ..., waited_on: _Optional[str] = ...) -> None: ...

class DescribeModelRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "engine", "shares_prefixes", "serves_only_model", "context_window_tokens", "context_windows", "models", "prompt_token_ratios")
    class ContextWindowsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PromptTokenRatiosEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    SHARES_PREFIXES_FIELD_NUMBER: _ClassVar[int]
    SERVES_ONLY_MODEL_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_RATIOS_FIELD_NUMBER: _ClassVar[int]
    model: str
    engine: str
    shares_prefixes: bool
    serves_only_model: bool
    context_window_tokens: int
    context_windows: _containers.ScalarMap[str, int]
    models: _containers.RepeatedScalarFieldContainer[str]
    prompt_token_ratios: _containers.ScalarMap[str, float]
    def __init__(self, model: _Optional[str] = ..., engine: _Optional[str] = ..., shares_prefixes: _Optional[bool] = ..., serves_only_model: _Optional[bool] = ..., context_window_tokens: _Optional[int] = ..., context_windows: _Optional[_Mapping[str, int]] = ..., models: _Optional[_Iterable[str]] = ..., prompt_token_ratios: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ToolWaitRequest(_message.Message):
    __slots__ = ("agent_id", "tool", "expected_wait_s", "tenant_id", "priority", "task_ended", "task_id")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TASK_ENDED_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    tool: str
    expected_wait_s: float
    tenant_id: str
    priority: Priority
    task_ended: bool
    task_id: str
    def __init__(self, agent_id: _Optional[str] = ..., tool: _Optional[str] = ..., expected_wait_s: _Optional[float] = ..., tenant_id: _Optional[str] = ..., priority: _Optional[_Union[Priority, str]] = ..., task_ended: _Optional[bool] = ..., task_id: _Optional[str] = ...) -> None: ...

class ToolWaitReply(_message.Message):
    __slots__ = ("decision", "restore_at_s")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    RESTORE_AT_S_FIELD_NUMBER: _ClassVar[int]
    decision: ToolWaitDecision
    restore_at_s: float
    def __init__(self, decision: _Optional[_Union[ToolWaitDecision, str]] = ..., restore_at_s: _Optional[float] = ...) -> None: ...

class StreamedGenerate(_message.Message):
    __slots__ = ("request", "timeout_s", "trace_context", "token_hold_s")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_HOLD_S_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    timeout_s: float
    trace_context: _containers.ScalarMap[str, str]
    token_hold_s: float
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., timeout_s: _Optional[float] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., token_hold_s: _Optional[float] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("start", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: _containers.RepeatedCompositeFieldContainer[StreamedGenerate]
    cancel: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, start: _Optional[_Iterable[_Union[StreamedGenerate, _Mapping]]] = ..., cancel: _Optional[_Iterable[str]] = ...) -> None: ...

class StreamedError(_message.Message):
    __slots__ = ("code", "details", "origin", "consumed")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    origin: str
    consumed: GenerateDone
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., origin: _Optional[str] = ..., consumed: _Optional[_Union[GenerateDone, _Mapping]] = ...) -> None: ...

class StreamedChunk(_message.Message):
    __slots__ = ("request_id", "chunk", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: GenerateChunk
    error: StreamedError
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[GenerateChunk, _Mapping]] = ..., error: _Optional[_Union[StreamedError, _Mapping]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[StreamedChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[StreamedChunk, _Mapping]]] = ...) -> None: ...
