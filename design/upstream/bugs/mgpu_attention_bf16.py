# jax.experimental.pallas.ops.gpu.attention_mgpu.attention traced with bf16
# inputs. Off a GPU, a stand-in for jax._src.lib.cuda_versions (None in a
# CPU-only jaxlib) lets the forward pass trace; on a Hopper GPU it is not
# needed.
import types

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention_mgpu

if attention_mgpu.cuda_versions is None:   # CPU-only jaxlib
  attention_mgpu.cuda_versions = types.SimpleNamespace(
      cuda_runtime_get_version=lambda: 12091)

config = attention_mgpu.TuningConfig(block_q=64, block_kv=64,
                                     max_concurrent_steps=2)
for dtype in (jnp.float16, jnp.bfloat16):
  q = jax.ShapeDtypeStruct((1, 128, 2, 64), dtype)
  try:
    jax.eval_shape(lambda q, k, v: attention_mgpu.attention(q, k, v, config),
                   q, q, q)
    print(dtype.__name__, "traces")
  except Exception as e:
    print(dtype.__name__, f"{type(e).__name__}: {e}")
