"""An equinox model whose layers call a Pallas kernel through
``smartvjp.filter_custom_vjp``: checkpointed per layer, scanned over stacked
layers, trained with SGD on a synthetic regression task.

Each residual layer is ``x + gelu(x @ w)`` with the matmul+GELU kernels of
``examples/pallas_gelu_matmul.py``. With ``equinox.filter_custom_vjp`` the
checkpointed layers run the training kernel ``fwd`` twice per step; with
``smartvjp.filter_custom_vjp`` the forward pass runs the inference kernel
``f`` and the backward pass ``fwd`` once (or the fused ``fwd_bwd``).

Run:  python examples/equinox_mlp.py
"""

from __future__ import annotations

import os
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
import pallas_gelu_matmul as PG  # noqa: E402

import smartvjp  # noqa: E402


class Dense(eqx.Module):
  w: jax.Array


def make_layer_op(deco, fused=False, count=False):
  """``op((layer, x)) -> gelu(x @ layer.w)`` with equinox's API."""
  _, rules = PG.make_gelu_matmul(block_m=32, block_n=32, count=count,
                                 interpret=True if count else None)

  @deco
  def op(layer_and_x):
    layer, x = layer_and_x
    return rules["f"](x, layer.w)

  @op.def_fwd
  def op_fwd(perturbed, layer_and_x):
    layer, x = layer_and_x
    return rules["fwd"](x, layer.w)

  @op.def_bwd
  def op_bwd(res, g, perturbed, layer_and_x):
    dx, dw = rules["bwd"](res, g)
    return Dense(dw), dx

  if fused:
    @op.def_fwd_bwd
    def op_fwd_bwd(g, perturbed, layer_and_x):
      layer, x = layer_and_x
      dx, dw = rules["fwd_bwd"](x, layer.w, g)
      return Dense(dw), dx
  return op


class MLP(eqx.Module):
  layers: Dense                     # stacked: w has shape [L, D, D]
  readout: jax.Array
  op: object = eqx.field(static=True)

  def __call__(self, x):
    @eqx.filter_checkpoint
    def layer(x, dense):
      return x + self.op((dense, x))

    def body(x, dense):
      return layer(x, dense), None

    x, _ = jax.lax.scan(body, x, self.layers)
    return x @ self.readout


def init(key, op, depth=4, width=32):
  k1, k2 = jax.random.split(key)
  w = jax.random.normal(k1, (depth, width, width)) * (0.5 / width ** 0.5)
  return MLP(Dense(w), jax.random.normal(k2, (width, 1)) / width ** 0.5, op)


def data(key, n=64, width=32):
  kx, kt = jax.random.split(key)
  x = jax.random.normal(kx, (n, width))
  target = jnp.sin(x[:, :1] * 2.0) + 0.5 * x[:, 1:2] ** 2
  return x, target


def loss_fn(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


@eqx.filter_jit
def sgd_step_with_grads(model, x, y, lr):
  loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
  model = jax.tree_util.tree_map(lambda p, g: p - lr * g, model, grads)
  return model, loss, grads


def sgd_step(model, x, y, lr):
  model, loss, _ = sgd_step_with_grads(model, x, y, lr)
  return model, loss


def first_step(deco, fused=False):
  """Kernel launches (``{rule: n}``) and gradients of one SGD step."""
  op = make_layer_op(deco, fused=fused, count=True)
  model = init(jax.random.key(0), op)
  x, y = data(jax.random.key(1))
  PG.LAUNCHES.clear()
  _, _, grads = jax.block_until_ready(sgd_step_with_grads(model, x, y, 0.1))
  jax.effects_barrier()
  return dict(PG.LAUNCHES), grads


def count_one_step(deco, fused=False):
  return first_step(deco, fused)[0]


def train(deco, fused=False, steps=300, lr=0.1, log_every=50):
  model = init(jax.random.key(0), make_layer_op(deco, fused=fused))
  x, y = data(jax.random.key(1))
  losses = []
  for step in range(steps):
    model, loss = sgd_step(model, x, y, lr)
    losses.append(float(loss))
    if log_every and step % log_every == 0:
      print(f"    step {step:4d}  loss {losses[-1]:.2e}", flush=True)
  return losses


def main(steps=300):
  t0 = time.perf_counter()
  print("One SGD step of an MLP of 4 checkpointed layers in a scan, counted by "
        "a callback in each kernel.")
  print("Under the checkpoint equinox's filter_custom_vjp runs fwd twice per "
        "layer; smartvjp's runs f in the")
  print("forward pass and fwd (or the fused fwd_bwd) once, in the backward "
        "pass.")
  print("Rule calls count f, fwd, bwd, fwd_bwd; kernel launches count kernels "
        "(bwd launches 2: dx, dw; fwd_bwd\n3: dy, dx, dw). Gradient difference: max "
        "|ours - equinox's| / max |equinox's| over all parameters.\n")
  print(f"  {'implementation':28s} {'rule calls':20s} {'kernel launches':20s} "
        "gradient difference")
  reference, calls, diffs = None, {}, {}
  for name, deco, fused in (("equinox.filter_custom_vjp", eqx.filter_custom_vjp,
                             False),
                            ("smartvjp.filter_custom_vjp",
                             smartvjp.filter_custom_vjp, False),
                            ("smartvjp + def_fwd_bwd",
                             smartvjp.filter_custom_vjp, True)):
    launches, grads = first_step(deco, fused)
    leaves = jax.tree_util.tree_leaves(eqx.filter(grads, eqx.is_array))
    if reference is None:
      reference, diff = leaves, "(the reference)"
    else:
      scale = max(float(jnp.max(jnp.abs(b))) for b in reference)
      diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                 zip(leaves, reference)) / scale
      diffs[name] = diff
      diff = f"{diff:.1e}"
    calls[name] = PG.fmt(PG.rule_calls(launches))
    print(f"  {name:28s} {PG.fmt(PG.rule_calls(launches)):20s} "
          f"{PG.fmt(launches):20s} {diff}")
  print(f"\nTraining with smartvjp.filter_custom_vjp, {steps} SGD steps; loss: "
        "mean squared error on the 64 training points:")
  losses = train(smartvjp.filter_custom_vjp, steps=steps)
  print(f"  loss {losses[0]:.2e} -> {losses[-1]:.2e} "
        f"({losses[-1] / losses[0]:.1e} of the first step's)")
  worst = max(diffs.values())
  change = ("does not change the gradients\n(bit for bit)" if worst == 0 else
            f"changes the gradients\nby at most {worst:.1e} (relative)")
  print(f"\nWhat to conclude: swapping equinox.filter_custom_vjp for "
        f"smartvjp.filter_custom_vjp {change} and, under the checkpoint, runs "
        f"{calls['smartvjp.filter_custom_vjp']} where equinox runs "
        f"{calls['equinox.filter_custom_vjp']}\n(one fwd per layer becomes the "
        f"cheaper f); with def_fwd_bwd, {calls['smartvjp + def_fwd_bwd']}.")
  print(f"Finished in {time.perf_counter() - t0:.1f} s.")
  return losses


if __name__ == "__main__":
  main()
