'use strict';
// A receiver of astra.weights.v1.WeightService/FetchVersion: opens the bidirectional stream
// with a FetchStart naming the version it holds, reads the plan, each tensor's header and
// chunks, decodes it (raw bytes, or one zstd frame of new XOR base: the delta format of
// weight_service.proto), checks the tensor's Adler-32, acknowledges it, and returns the new
// version once FetchDone arrives: the tensors sent, and for a delta every other tensor of the
// base unchanged. After a disconnect or a tensor that fails its checksum it opens a new
// stream naming the tensors it has verified (acknowledged_tensors), and the service resumes
// after them. Nothing is returned before a stream ends with FetchDone, so a caller swaps
// complete, verified versions only.

const grpc = require('@grpc/grpc-js');
const fzstd = require('fzstd');

const MOD = 65521;
const NMAX = 5552; // the most bytes before the sums must be reduced (zlib's bound)

function adler32(buf, value = 1) {
  let a = value & 0xffff;
  let b = (value >>> 16) & 0xffff;
  for (let i = 0; i < buf.length; ) {
    const end = Math.min(i + NMAX, buf.length);
    for (; i < end; i++) {
      a += buf[i];
      b += a;
    }
    a %= MOD;
    b %= MOD;
  }
  return ((b << 16) | a) >>> 0;
}

function hex8(value) {
  return value.toString(16).padStart(8, '0');
}

class FetchError extends Error {
  constructor(code, message, reason) {
    super(message);
    this.code = code;
    this.reason = reason;
  }
}

const lost = (message, reason) => new FetchError(grpc.status.DATA_LOSS, message, reason);

// The new bytes of one tensor from its encoded bytes: raw as they came, or xor+zstd decoded
// against the base's bytes of the same name.
function decode(header, encoded, baseTensors) {
  if (header.encoding === 'TENSOR_ENCODING_RAW') return encoded;
  if (header.encoding !== 'TENSOR_ENCODING_XOR_ZSTD') {
    throw lost(`tensor ${header.name}: unknown encoding ${header.encoding}`, 'UNKNOWN_ENCODING');
  }
  const base = baseTensors && baseTensors.get(header.name);
  if (!base || base.length !== header.size_bytes) {
    throw lost(`tensor ${header.name}: a delta without a base tensor of ${header.size_bytes} bytes`, 'WRONG_BASE');
  }
  let out;
  try {
    const u = fzstd.decompress(encoded, new Uint8Array(header.size_bytes));
    out = Buffer.from(u.buffer, u.byteOffset, u.byteLength);
  } catch (err) {
    throw lost(`tensor ${header.name}: the zstd frame does not decode: ${err.message}`, 'BAD_FRAME');
  }
  if (out.length !== header.size_bytes) {
    throw lost(`tensor ${header.name}: decoded ${out.length} bytes, header says ${header.size_bytes}`, 'SIZE_MISMATCH');
  }
  for (let i = 0; i < out.length; i++) out[i] ^= base[i];
  return out;
}

const MAX_ATTEMPTS = 5;
const BACKOFF_MS = 100;
// What a new stream may cure: a dropped connection, a busy or restarting service, bytes
// damaged on the way. Not a plan against a version this receiver does not hold.
const RETRYABLE = new Set([
  grpc.status.UNAVAILABLE,
  grpc.status.DATA_LOSS,
  grpc.status.INTERNAL,
  grpc.status.UNKNOWN,
  grpc.status.RESOURCE_EXHAUSTED,
  grpc.status.ABORTED,
]);

// One FetchVersion stream. `verified` (name -> Buffer) holds the tensors earlier streams of
// this fetch verified: they are named as acknowledged, and every tensor this stream verifies
// is added to it as it is acknowledged. `state.target` is the identity asked for, set from the
// plan when it was "". Resolves with { tensors, base } once FetchDone arrives; rejects with a
// FetchError. `bytes.n` counts the chunk bytes received.
function fetchOnce(client, policy, state, receiverId, deadline, held, verified, bytes) {
  return new Promise((resolve, reject) => {
    const call = client.FetchVersion({ deadline });
    let tensors = null;
    let base = '';
    const target = state.target;
    let current = null;
    let done = false;
    let failed = null;

    const fail = (err) => {
      if (!failed) failed = err;
      call.cancel();
    };
    const finish = (t) => {
      const name = t.header.name;
      let data;
      try {
        data = decode(t.header, Buffer.concat(t.parts, t.got), held && held.tensors);
      } catch (err) {
        return fail(err);
      }
      const got = hex8(adler32(data));
      if (data.length !== t.header.size_bytes || got !== t.header.adler32) {
        const why = `adler32 ${got} of ${data.length} bytes, expected ${t.header.adler32} of ${t.header.size_bytes}`;
        call.write({ ack: { name, status: { code: grpc.status.DATA_LOSS, message: why } } });
        return fail(lost(`tensor ${name}: ${why}`, 'CHECKSUM_MISMATCH'));
      }
      verified.set(name, data);
      current = null;
      call.write({ ack: { name, status: { code: grpc.status.OK } } });
    };

    call.on('data', (msg) => {
      if (failed) return;
      switch (msg.part) {
        case 'plan':
          base = msg.plan.base_version_id;
          state.target = msg.plan.target.version_id; // "" resolved: a resume names it
          if (base && (!held || base !== held.version_id)) {
            const wrong = lost(`a delta against ${base}, which this receiver does not hold`, 'WRONG_BASE');
            wrong.final = true;
            return fail(wrong);
          }
          // A delta leaves the base's other tensors as they are; a full copy sends them all.
          tensors = base ? new Map(held.tensors) : new Map();
          break;
        case 'tensor': {
          const h = msg.tensor;
          const size = h.encoding === 'TENSOR_ENCODING_RAW' ? h.size_bytes : h.encoded_size_bytes;
          current = { header: h, size, parts: [], got: 0 };
          if (size === 0) finish(current);
          break;
        }
        case 'chunk':
          if (!current || msg.chunk.offset !== current.got) {
            return fail(lost(`chunk at offset ${msg.chunk.offset} out of order`, 'CHUNK_OUT_OF_ORDER'));
          }
          current.parts.push(msg.chunk.data);
          current.got += msg.chunk.data.length;
          bytes.n += msg.chunk.data.length;
          if (current.got >= current.size) finish(current); // more than announced: refused there
          break;
        case 'done':
          if (current) return fail(lost(`FetchDone inside tensor ${current.header.name}`, 'TRUNCATED'));
          done = true;
          call.end();
          break;
        default: // VersionFile: config and tokenizer files, not needed without a model
          break;
      }
    });
    call.on('error', (err) => {
      if (failed) return reject(failed);
      reject(new FetchError(err.code, err.details || err.message, 'FETCH_FAILED'));
    });
    call.on('end', () => {
      if (failed) return reject(failed);
      if (!done || !tensors) {
        return reject(new FetchError(grpc.status.UNAVAILABLE, 'the fetch stream ended before FetchDone', 'FETCH_INCOMPLETE'));
      }
      for (const [name, data] of verified) tensors.set(name, data);
      resolve({ tensors, base });
    });
    call.write({
      start: {
        policy_id: policy,
        target_version_id: target,
        held_version_ids: held ? [held.version_id] : [],
        receiver_id: receiverId,
        // Honoured only with an explicit target; none is verified before the plan names it.
        acknowledged_tensors: target ? [...verified.keys()] : [],
        max_bytes_per_second: 0,
      },
    });
  });
}

// Fetches `versionId` of `policy` from the WeightService at `address`, naming `held`
// ({ version_id, tensors }, or null) as the version this receiver has; up to MAX_ATTEMPTS
// streams within `timeoutS` in all, each resuming after the tensors verified before it.
// `onRetry(err, attempt, verifiedCount)` is told of each new stream. Resolves with
// { tensors: Map(name -> Buffer), bytes, base, attempts } or rejects with a FetchError.
async function fetchVersion(proto, address, policy, versionId, receiverId, timeoutS, held, onRetry) {
  const client = new proto.WeightService(address, proto.clientCredentials(), {
    'grpc.max_receive_message_length': 64 << 20,
    'grpc.max_send_message_length': 64 << 20,
  });
  const deadline = new Date(Date.now() + timeoutS * 1000);
  const verified = new Map();
  const bytes = { n: 0 };
  const state = { target: versionId };
  try {
    for (let attempt = 1; ; attempt++) {
      try {
        const got = await fetchOnce(client, policy, state, receiverId, deadline, held, verified, bytes);
        return { tensors: got.tensors, bytes: bytes.n, base: got.base, attempts: attempt };
      } catch (err) {
        const wait = BACKOFF_MS * 2 ** (attempt - 1);
        const final = err.final || !RETRYABLE.has(err.code) || attempt >= MAX_ATTEMPTS;
        if (final || Date.now() + wait >= deadline.getTime()) {
          err.message = `WeightService ${address}: ${err.message} (attempt ${attempt})`;
          throw err;
        }
        if (onRetry) onRetry(err, attempt, verified.size);
        await new Promise((r) => setTimeout(r, wait));
      }
    }
  } finally {
    client.close();
  }
}

module.exports = { fetchVersion, adler32, FetchError };
