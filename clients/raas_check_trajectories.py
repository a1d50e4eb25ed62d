"""The trajectory-shape check of `astra raas check`: what Dataflow's decoder lets through but
the trainer refuses (rollout.proto, Sequence).

A set of checks on astra.clients.raas_check_session.CheckSession, joined in
astra.clients.raas_check.RaasChecker, run on the group `collect` received:
every sequence sets a finish reason (unset is a failed trajectory), starts with its
prompt's tokens (prompt_length >= 1, loss_mask 0 there), trains on at least one
generated token (loss_mask 1 after the prompt), carries a version >= 0 on every
trained token, and has no negative token id. The upper bound of token ids
(config.json vocab_size) is not known over the wire and not checked.
"""

from __future__ import annotations

import numpy as np

from astra.clients.raas_check_session import CheckSession
from astra.clients.raas_rules import CheckFailed
from astra.common.arrays import from_array


class TrajectoryChecks(CheckSession):
    async def trajectories_are_well_formed(self) -> str:
        self._needs("group")
        _, wire = self.decoded[self.group]
        n = 0
        for i, t in enumerate(wire.result.trajectories):
            for j, s in enumerate(t.sequences):
                where = f"trajectories[{i}].sequences[{j}]"
                if s.finish_reason == 0:
                    raise CheckFailed(f"{where}.finish_reason unset (STOP, LENGTH or ABORTED)")
                ids = from_array(s.token_ids, f"{where}.token_ids")
                mask = from_array(s.loss_mask, f"{where}.loss_mask").astype(bool)
                versions = from_array(s.weight_versions, f"{where}.weight_versions")
                if (ids < 0).any():
                    raise CheckFailed(f"{where}.token_ids: negative id {int(ids.min())}")
                if not 1 <= s.prompt_length < len(ids):
                    raise CheckFailed(
                        f"{where}.prompt_length {s.prompt_length} of {len(ids)} tokens: the "
                        "prompt's tokens first, then at least one generated"
                    )
                if mask[: s.prompt_length].any():
                    raise CheckFailed(f"{where}.loss_mask: 1 on a prompt token")
                if not mask[s.prompt_length :].any():
                    raise CheckFailed(f"{where}.loss_mask: no generated token trained on")
                if len(versions) == len(ids) and (versions[mask] < 0).any():
                    bad = int(np.flatnonzero(mask & (versions < 0))[0])
                    raise CheckFailed(f"{where}.weight_versions[{bad}] < 0 on a trained token")
                n += 1
        return f"{n} sequences: finish reason set, prompt then generated tokens, versions on each"
