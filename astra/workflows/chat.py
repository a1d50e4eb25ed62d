"""The `chat` workflow: `single_turn` with the prompt put through the model's chat template.

The record's prompt becomes the user's message (after its optional `system`
field as the system message), rendered by the policy's tokenizer's chat
template with the assistant's turn opened (astra.engine.chat); the model's
reply is generated, scored and trained on exactly as in `single_turn`. A
model without a chat template cannot run it: `astra run` refuses the recipe
at start-up, and a RaaS fails each episode saying so.
"""

from __future__ import annotations

from astra.workflows.base import WorkflowContext
from astra.workflows.registry import register_workflow
from astra.workflows.single_turn import SingleTurn


@register_workflow("chat")
class Chat(SingleTurn):
    chat = True  # chat-shaped: needs a model with a chat template

    def prompt_ids(self, ctx: WorkflowContext, policy_id: str) -> list[int]:
        return ctx.chat_prompt_ids(policy_id)
