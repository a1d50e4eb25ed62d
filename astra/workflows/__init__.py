"""Workflows: how one prompt becomes one scored episode, found by name.

Built-ins: single_turn (RLVR), chat (single_turn through the model's chat
template), multi_turn_tools (calculator and Python sandbox tools), multi_agent (solver and
verifier), agent (a program through the OpenAI endpoint), verifiers (a `verifiers`
environment through the same endpoint), openenv (an OpenEnv environment through its client).
Plugins: entry-point group `astra.workflows` (workflows) and `astra.tools` (tools).
"""

from astra.workflows import (
    agent,
    chat,
    multi_agent,
    multi_turn,
    openenv_env,
    single_turn,
    verifiers_env,
)
from astra.workflows.base import (
    RewardFailed,
    Workflow,
    WorkflowContext,
    run_episode,
    sample_seed,
)
from astra.workflows.episode import GenerationFailed, SequenceBuilder
from astra.workflows.registry import (
    WORKFLOWS,
    UnknownWorkflow,
    get_workflow,
    known_workflows,
    register_workflow,
)
from astra.workflows.tools import TOOLS, ToolError, UnknownTool, register_tool, run_tool

__all__ = [
    "TOOLS",
    "WORKFLOWS",
    "GenerationFailed",
    "RewardFailed",
    "SequenceBuilder",
    "ToolError",
    "UnknownTool",
    "UnknownWorkflow",
    "Workflow",
    "WorkflowContext",
    "agent",
    "chat",
    "get_workflow",
    "known_workflows",
    "multi_agent",
    "multi_turn",
    "openenv_env",
    "register_tool",
    "register_workflow",
    "run_episode",
    "run_tool",
    "sample_seed",
    "single_turn",
    "verifiers_env",
]
