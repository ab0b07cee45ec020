"""flax fp8 training, a few SGD steps (``--case dot`` or ``--case einsum``).

``dot``: two ``nn.Dense`` layers with ``dot_general_cls=nn.Fp8DotGeneral``;
``einsum``: two ``nn.Fp8Einsum`` contractions. The fp8 meta variables
(scales and amax histories, collection ``_overwrite_with_gradient``) are
replaced by their gradients after each step, as flax's ``TrainState`` does;
everything else takes an SGD step. Records per step the loss, the gradients,
the parameters and the fp8 meta variables.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

rec = _harness.start("flax", "flax.linen")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import flax.linen as nn  # noqa: E402
from flax.linen import fp8_ops  # noqa: E402

OWG = fp8_ops.OVERWRITE_WITH_GRADIENT
STEPS, LR = 4, 0.1


class DotNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16, dot_general_cls=nn.Fp8DotGeneral)(x)
    return nn.Dense(4, dot_general_cls=nn.Fp8DotGeneral)(jax.nn.gelu(h))


class EinsumNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    init = nn.initializers.lecun_normal()
    w1 = self.param("w1", init, (8, 16))
    w2 = self.param("w2", init, (16, 4))
    h = nn.Fp8Einsum(name="e1")("bi,ij->bj", x, w1)
    return nn.Fp8Einsum(name="e2")("bj,jk->bk", jax.nn.gelu(h), w2)


def main():
  model = {"dot": DotNet, "einsum": EinsumNet}[rec.case]()
  kx, kw, ki = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (32, 8), jnp.float32)
  y = jnp.tanh(x @ jax.random.normal(kw, (8, 4), jnp.float32))
  variables = model.init(ki, x)
  params, meta = variables["params"], variables[OWG]

  def loss_fn(params, meta):
    out = model.apply({"params": params, OWG: meta}, x)
    return jnp.mean((out - y) ** 2)

  rec.check_swap(str(jax.make_jaxpr(loss_fn)(params, meta)))
  step = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))
  for i in range(STEPS):
    loss, (g_params, g_meta) = step(params, meta)
    params = jax.tree_util.tree_map(lambda p, g: p - LR * g, params, g_params)
    meta = g_meta  # overwrite with gradient
    rec.add(f"step{i}/loss", loss)
    rec.add(f"step{i}/grad", g_params)
    rec.add(f"step{i}/params", params)
    rec.add(f"step{i}/fp8_meta", meta)
  rec.save()


main()
