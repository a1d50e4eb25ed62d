'use strict';
// A receiver of astra.weights.v1.WeightService/FetchVersion: opens the bidirectional stream
// with a FetchStart, reads the plan, each tensor's header and chunks, checks the tensor's
// Adler-32 and acknowledges it, and returns the tensors once FetchDone arrives. Nothing is
// kept from a stream that did not end with FetchDone, so a caller swaps complete versions
// only.
//
// It names no held version, so the service always sends a full copy as raw bytes: Node 20
// has no zstd to decode the xor+zstd frames of a delta. A disconnect fails the fetch (the
// caller tries again from the start) instead of resuming with acknowledged_tensors.

const grpc = require('@grpc/grpc-js');

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

// Fetches `versionId` of `policy` from the WeightService at `address`; resolves with
// { tensors: Map(name -> Buffer), bytes } or rejects with a FetchError (a grpc status code).
function fetchVersion(proto, address, policy, versionId, receiverId, timeoutS) {
  const client = new proto.WeightService(address, proto.clientCredentials(), {
    'grpc.max_receive_message_length': 64 << 20,
    'grpc.max_send_message_length': 64 << 20,
  });
  return new Promise((resolve, reject) => {
    const deadline = new Date(Date.now() + timeoutS * 1000);
    const call = client.FetchVersion({ deadline });
    const tensors = new Map();
    let current = null;
    let done = false;
    let failed = null;
    let bytes = 0;

    const fail = (err) => {
      if (!failed) failed = err;
      call.cancel();
    };
    const finish = (t) => {
      const data = Buffer.concat(t.parts, t.got);
      const got = hex8(adler32(data));
      if (t.header.size_bytes !== data.length) {
        return fail(new FetchError(grpc.status.DATA_LOSS, `${t.header.name}: ${data.length} bytes, header says ${t.header.size_bytes}`, 'SIZE_MISMATCH'));
      }
      if (got !== t.header.adler32) {
        call.write({ ack: { name: t.header.name, status: { code: grpc.status.DATA_LOSS, message: `adler32 ${got}, expected ${t.header.adler32}` } } });
        return fail(new FetchError(grpc.status.DATA_LOSS, `tensor ${t.header.name}: adler32 ${got}, expected ${t.header.adler32}`, 'CHECKSUM_MISMATCH'));
      }
      tensors.set(t.header.name, data);
      call.write({ ack: { name: t.header.name, status: { code: grpc.status.OK } } });
    };

    call.on('data', (msg) => {
      if (failed) return;
      switch (msg.part) {
        case 'plan':
          if (msg.plan.base_version_id) {
            return fail(new FetchError(grpc.status.INTERNAL, `a delta against ${msg.plan.base_version_id} for a receiver that holds nothing`, 'UNEXPECTED_DELTA'));
          }
          break;
        case 'tensor':
          if (msg.tensor.encoding !== 'TENSOR_ENCODING_RAW') {
            return fail(new FetchError(grpc.status.INTERNAL, `${msg.tensor.name}: encoding ${msg.tensor.encoding} in a full copy`, 'UNEXPECTED_ENCODING'));
          }
          current = { header: msg.tensor, parts: [], got: 0 };
          if (msg.tensor.size_bytes === 0) finish(current);
          break;
        case 'chunk':
          if (!current || msg.chunk.offset !== current.got) {
            return fail(new FetchError(grpc.status.DATA_LOSS, `chunk at offset ${msg.chunk.offset} out of order`, 'CHUNK_OUT_OF_ORDER'));
          }
          current.parts.push(msg.chunk.data);
          current.got += msg.chunk.data.length;
          bytes += msg.chunk.data.length;
          if (current.got === current.header.size_bytes) finish(current);
          else if (current.got > current.header.size_bytes) finish(current); // refused there
          break;
        case 'done':
          done = true;
          call.end();
          break;
        default: // VersionFile: config and tokenizer files, not needed without a model
          break;
      }
    });
    call.on('error', (err) => {
      client.close();
      if (failed) return reject(failed);
      reject(new FetchError(err.code, `WeightService ${address}: ${err.details || err.message}`, 'FETCH_FAILED'));
    });
    call.on('end', () => {
      client.close();
      if (failed) return reject(failed);
      if (!done) return reject(new FetchError(grpc.status.UNAVAILABLE, 'the fetch stream ended before FetchDone', 'FETCH_INCOMPLETE'));
      resolve({ tensors, bytes });
    });
    call.write({
      start: {
        policy_id: policy,
        target_version_id: versionId,
        held_version_ids: [],
        receiver_id: receiverId,
        acknowledged_tensors: [],
        max_bytes_per_second: 0,
      },
    });
  });
}

module.exports = { fetchVersion, adler32, FetchError };
