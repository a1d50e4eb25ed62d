'use strict';
// Finished results, held until acknowledged (rollout_service.proto: at-least-once delivery):
// each is answered by every CollectResults and CollectResultBatch, oldest first, until
// AckResults or a CollectResultBatch's ack_group_ids names it; and the long poll both share
// (a call with nothing ready waits up to its max_wait, answered as soon as a result is there).

const REMEMBERED_ACKS = 100000; // acknowledged ids a resubmission is still recognised by

class Results {
  constructor() {
    this.pending = new Map(); // group id -> { result, bytes }, oldest first (insertion order)
    this.acked = new Set(); // recently acknowledged ids, oldest first
    this.waiters = new Set(); // calls waiting for a result
  }

  get size() {
    return this.pending.size;
  }

  // Whether `groupId` finished here and is held, or was acknowledged recently.
  holds(groupId) {
    return this.pending.has(groupId) || this.acked.has(groupId);
  }

  // A finished group's result; `bytes`: its size as one `results` entry on the wire.
  add(groupId, result, bytes) {
    this.pending.set(groupId, { result, bytes });
    for (const wake of this.waiters) wake();
  }

  // Drops the results `ids` name; unknown and already acknowledged ids are ignored. Returns
  // how many were dropped.
  acknowledge(ids) {
    let acknowledged = 0;
    for (const id of ids) {
      if (this.pending.delete(id)) {
        acknowledged += 1;
        this.acked.add(id);
      }
    }
    while (this.acked.size > REMEMBERED_ACKS) this.acked.delete(this.acked.values().next().value);
    return acknowledged;
  }

  // The oldest results, at most `maxGroups`, whose sizes add up to at most `maxBytes` (the
  // first always: one result alone is bounded when it finishes). Not removed by being sent.
  oldest(maxGroups, maxBytes = Infinity) {
    const out = [];
    let total = 0;
    for (const { result, bytes } of this.pending.values()) {
      if (out.length >= maxGroups || (out.length > 0 && total + bytes > maxBytes)) break;
      out.push(result);
      total += bytes;
    }
    return out;
  }

  // Calls `answer()` once, as soon as a result is pending or when `waitS` has passed; never
  // for a call its client cancelled first.
  whenReady(call, waitS, answer) {
    let finished = false;
    const done = () => {
      finished = true;
      clearTimeout(timer);
      this.waiters.delete(send);
    };
    const send = () => {
      if (finished) return;
      done();
      if (!call.cancelled) answer();
    };
    const timer = setTimeout(send, waitS * 1000);
    call.on('cancelled', done);
    if (this.pending.size > 0 || waitS === 0) return send();
    this.waiters.add(send);
  }
}

module.exports = { Results };
