"""The trainer: pulls batches from Dataflow, updates the policy, publishes versions, checkpoints.

Modules: config (typed settings), losses (GRPO/PPO token losses, staleness),
batch (trajectories -> tensors, packing), step (one optimiser step), parallel
(FSDP2), feed (request ids, validation, acks), publisher (background publish
+ announce), checkpoint/state (checkpoints), setup (model, services, version
agreement), ranks (rank 0 leads followers), loop (`Trainer`), sources
(Dataflow/WeightService adapters), synthetic (in-memory source and sink),
cli (`astra serve trainer`, `python -m astra.trainer`). Importing this
package imports nothing heavy.
"""
