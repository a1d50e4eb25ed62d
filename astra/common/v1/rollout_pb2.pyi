from astra.common.v1 import array_pb2 as _array_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.rpc import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORTED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORTED: FinishReason
FINISH_REASON_ERROR: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_strings", "stop_token_ids", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_strings: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("text", "token_ids", "data")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _array_pb2.NDArray
    data: _struct_pb2.Struct
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[_array_pb2.NDArray, _Mapping]] = ..., data: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class PromptGroup(_message.Message):
    __slots__ = ("group_id", "workflow", "policy_ids", "prompt", "num_samples", "sampling_params", "reward", "epoch", "regenerate")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    WORKFLOW_FIELD_NUMBER: _ClassVar[int]
    POLICY_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REGENERATE_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    workflow: str
    policy_ids: _containers.RepeatedScalarFieldContainer[str]
    prompt: Prompt
    num_samples: int
    sampling_params: SamplingParams
    reward: str
    epoch: int
    regenerate: bool
    def __init__(self, group_id: _Optional[str] = ..., workflow: _Optional[str] = ..., policy_ids: _Optional[_Iterable[str]] = ..., prompt: _Optional[_Union[Prompt, _Mapping]] = ..., num_samples: _Optional[int] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., reward: _Optional[str] = ..., epoch: _Optional[int] = ..., regenerate: _Optional[bool] = ...) -> None: ...

class Sequence(_message.Message):
    __slots__ = ("policy_id", "agent_id", "prompt_length", "token_ids", "logprobs", "loss_mask", "weight_versions", "finish_reason", "reward")
    POLICY_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    policy_id: str
    agent_id: str
    prompt_length: int
    token_ids: _array_pb2.NDArray
    logprobs: _array_pb2.NDArray
    loss_mask: _array_pb2.NDArray
    weight_versions: _array_pb2.NDArray
    finish_reason: FinishReason
    reward: float
    def __init__(self, policy_id: _Optional[str] = ..., agent_id: _Optional[str] = ..., prompt_length: _Optional[int] = ..., token_ids: _Optional[_Union[_array_pb2.NDArray, _Mapping]] = ..., logprobs: _Optional[_Union[_array_pb2.NDArray, _Mapping]] = ..., loss_mask: _Optional[_Union[_array_pb2.NDArray, _Mapping]] = ..., weight_versions: _Optional[_Union[_array_pb2.NDArray, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., reward: _Optional[float] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("trajectory_id", "group_id", "sample_index", "sequences", "reward", "agent_rewards", "metadata", "error", "advantage")
    class AgentRewardsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    AGENT_REWARDS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    group_id: str
    sample_index: int
    sequences: _containers.RepeatedCompositeFieldContainer[Sequence]
    reward: float
    agent_rewards: _containers.ScalarMap[str, float]
    metadata: _struct_pb2.Struct
    error: _status_pb2.Status
    advantage: float
    def __init__(self, trajectory_id: _Optional[str] = ..., group_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[Sequence, _Mapping]]] = ..., reward: _Optional[float] = ..., agent_rewards: _Optional[_Mapping[str, float]] = ..., metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ..., advantage: _Optional[float] = ...) -> None: ...

class GroupResult(_message.Message):
    __slots__ = ("group_id", "trajectories", "error", "instance_id")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    trajectories: _containers.RepeatedCompositeFieldContainer[Trajectory]
    error: _status_pb2.Status
    instance_id: str
    def __init__(self, group_id: _Optional[str] = ..., trajectories: _Optional[_Iterable[_Union[Trajectory, _Mapping]]] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ..., instance_id: _Optional[str] = ...) -> None: ...
