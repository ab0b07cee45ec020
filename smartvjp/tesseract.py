"""Tesseracts (tesseract-core) as ``smart_custom_vjp`` calls.

``apply_tesseract(tesseract, inputs)`` has tesseract-jax's signature: it runs
the Tesseract's ``apply`` endpoint on a nested dict of inputs and returns its
outputs, and under ``jax.grad``/``jax.vjp`` its ``vector_jacobian_product``
endpoint gives the gradient. It is built on :class:`smartvjp.smart_custom_vjp`,
so ``jax.checkpoint`` decides what runs where as for any smart call, and a
Tesseract that takes part in the *residual contract* below lets the gradient
skip the forward re-run that a plain VJP endpoint does (seed 003,
pasteurlabs/tesseract-jax#27).

The residual contract (opt-in, by schema): the Tesseract's ``apply`` inputs
have a bool field ``save_residuals`` (default False) and an optional field
``residuals``, and its outputs an optional field ``residuals``. ``apply`` with
``save_residuals=True`` also returns what its adjoint needs as ``residuals``
(any arrays, declared by ``abstract_eval`` when the flag is set);
``vector_jacobian_product`` given ``residuals`` among its inputs uses them
instead of recomputing. Then, without ``jax.checkpoint`` (or with a policy
that saves everything), the forward pass runs ``apply`` with residuals and the
backward pass the VJP from them; under ``jax.checkpoint`` the forward pass
runs the plain ``apply`` and the backward pass the plain VJP (least memory).

Nothing of a gradient is kept on the server: ``apply`` sends the residuals to
the client with its outputs, and the VJP request sends them back. On the
client they are arrays that JAX holds like any other residual (buffers of the
compiled program between its forward and backward parts; the ``jax.vjp``
function or the ``jax.linearize`` one for as long as it lives), and they go
when JAX drops them: there is no handle to release and nothing that a lost
client leaves behind (tests/test_tesseract.py runs 200 gradient steps against
a served Tesseract and checks that its memory does not grow). A Tesseract
author adds the contract with :func:`contract_schemas` (the fields) and
:func:`with_residuals` (``abstract_eval``'s answer), and checks it with
:func:`check_residual_contract`.

``abstract_eval`` runs once per Tesseract object and input structure; a
served Tesseract should be made with a ``timeout``
(``Tesseract.from_url(url, timeout=...)``), so that a server that stops
answering ends the program with a :class:`TesseractEndpointError` instead of
a wait without end.

This module imports ``tesseract_core`` (the ``tesseract`` extra: ``pip install
-e ".[tesseract]"`` in the clone, on Python 3.12 or newer, which tesseract-jax
0.5 needs); ``import smartvjp`` does not import it.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from tesseract_core import Tesseract

from smartvjp import smart_custom_vjp

__all__ = ["apply_tesseract", "TesseractEndpointError", "SAVE_RESIDUALS",
           "RESIDUALS", "contract_schemas", "with_residuals",
           "check_residual_contract", "ResidualContractError"]

SAVE_RESIDUALS = "save_residuals"
"""The contract's input flag: ``apply`` also returns ``residuals``."""
RESIDUALS = "residuals"
"""The contract's field: an output of ``apply``, an input of the VJP."""

def _register_tesseract_pytree():
  """A Tesseract is a pytree node without children (its own static data),
  so that ``jax.jit`` takes one as an argument, as tesseract-jax makes it at
  import. Where tesseract-jax is installed its import does it (a second
  registration would make that import fail); else it is done here."""
  try:
    # pylint: disable-next=import-outside-toplevel,unused-import
    import tesseract_jax  # noqa: F401
    return
  except ImportError:
    pass
  try:
    jax.tree_util.register_pytree_node(Tesseract, lambda t: ((), t),
                                       lambda t, _: t)
  except ValueError:   # registered already
    pass


_register_tesseract_pytree()

_VMAP_METHODS = ("auto", "auto_experimental", "sequential", "expand_dims",
                 "broadcast_all")


class TesseractEndpointError(RuntimeError):
  """An endpoint of a Tesseract failed; the message names the endpoint, the
  Tesseract's address (a URL, or ``in-process``) and the endpoint's own error.
  Under ``jit`` JAX reports it inside a ``JaxRuntimeError``, whose last line
  is this message."""


# -- what the schema says ------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Schema:
  where: str                  # the address, for messages
  endpoints: frozenset
  diff_inputs: tuple          # path templates ("a.{}", "b.[]", "c.w")
  diff_outputs: tuple
  contract: bool
  batches_itself: bool        # every differentiable array is Array[..., ...]


_SCHEMAS: "weakref.WeakKeyDictionary[Tesseract, _Schema]" = (
    weakref.WeakKeyDictionary())


def _where(tesseract) -> str:
  url = getattr(getattr(tesseract, "_client", None), "url", None)
  return f"at {url}" if url else "(in-process)"


def _schema(tesseract) -> _Schema:
  try:
    return _SCHEMAS[tesseract]
  except (KeyError, TypeError):
    pass
  where = _where(tesseract)
  try:
    schemas = tesseract.openapi_schema["components"]["schemas"]
    endpoints = frozenset(tesseract.available_endpoints)
  except Exception as e:  # noqa: BLE001 - re-raised with the address
    raise TesseractEndpointError(
        f"Tesseract {where}: reading its schema failed: "
        f"{type(e).__name__}: {e}") from e
  diff_in = schemas["ApplyInputSchema"].get("differentiable_arrays", {})
  diff_out = schemas["ApplyOutputSchema"].get("differentiable_arrays", {})
  in_fields = set(schemas.get("Apply_InputSchema", {}).get("properties", {}))
  out_fields = set(schemas.get("Apply_OutputSchema", {}).get("properties", {}))
  contract = ({SAVE_RESIDUALS, RESIDUALS} <= in_fields
              and RESIDUALS in out_fields)
  batches = bool(diff_in) and all("shape" not in s for s in
                                  [*diff_in.values(), *diff_out.values()])
  schema = _Schema(where, endpoints, tuple(diff_in), tuple(diff_out),
                   contract, batches)
  try:
    _SCHEMAS[tesseract] = schema
  except TypeError:
    pass
  return schema


def _segments(keypath) -> list:
  out = []
  for k in keypath:
    if isinstance(k, jax.tree_util.DictKey):
      out.append(("key", str(k.key)))
    elif isinstance(k, jax.tree_util.SequenceKey):
      out.append(("idx", k.idx))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      out.append(("key", k.name))
    else:
      out.append(("key", str(k)))
  return out


def _escape(key: str) -> str:
  return "".join("\\" + c if c in "{}\\" else c for c in key)


def _match(segments, template: str):
  """The Tesseract path of a leaf if it matches ``template``, else None."""
  parts = template.split(".") if template else []
  if len(parts) != len(segments):
    return None
  out = []
  for (kind, v), t in zip(segments, parts):
    if kind == "idx" and t == "[]":
      out.append(f"[{v}]")
    elif kind == "key" and t == "{}":
      out.append("{" + _escape(v) + "}")
    elif kind == "key" and t == v:
      out.append(v)
    else:
      return None
  return ".".join(out)


def _path(segments, templates):
  """(Tesseract path, differentiable) for one leaf."""
  for t in templates:
    p = _match(segments, t)
    if p is not None:
      return p, True
  return ".".join(f"[{v}]" if k == "idx" else v for k, v in segments), False


def _is_aval(x) -> bool:
  return isinstance(x, dict) and "shape" in x and "dtype" in x


def _get(tree, segments):
  for _, v in segments:
    tree = tree[v]
  return tree


# -- one call's layout ---------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class _Layout:
  tesseract: Any
  schema: _Schema
  in_treedef: Any
  in_leaves: tuple            # static leaves, or None where an array goes
  in_paths: tuple             # per array operand: Tesseract path
  in_diff: tuple              # per array operand: differentiable
  out_treedef: Any
  out_static: tuple           # per output leaf: static value, or _ARRAY
  out_segments: tuple         # per array output: key path in apply's result
  out_paths: tuple
  out_diff: tuple
  out_avals: tuple            # ShapeDtypeStruct per array output
  res_treedef: Any            # the contract's residuals (the RESIDUALS field)
  res_avals: tuple


_ARRAY = object()


def _inputs(layout: _Layout, arrays) -> dict:
  it = iter(arrays)
  leaves = [next(it) if leaf is _ARRAY else leaf for leaf in layout.in_leaves]
  return jax.tree_util.tree_unflatten(layout.in_treedef, leaves)


def _endpoint(layout: _Layout, name: str, **kwargs):
  return _call_endpoint(layout.tesseract, layout.schema, name, **kwargs)


def _call_endpoint(tesseract, schema: _Schema, name: str, **kwargs):
  if name not in schema.endpoints:
    raise NotImplementedError(
        f"Tesseract {schema.where} has no {name} endpoint, which "
        f"this transformation needs; its endpoints: "
        f"{', '.join(sorted(schema.endpoints))}.")
  try:
    return getattr(tesseract, name)(**kwargs)
  except Exception as e:  # noqa: BLE001 - re-raised with endpoint and address
    raise TesseractEndpointError(
        f"Tesseract {schema.where}: endpoint {name} failed"
        f"{_hint(e)}: {type(e).__name__}: {e}") from e


def _hint(e: Exception) -> str:
  """What a served Tesseract's transport error means (requests' classes,
  recognised by name: smartvjp does not import requests)."""
  names = {c.__name__ for c in type(e).__mro__}
  if "Timeout" in names:
    return (" (the server did not answer within the timeout given to "
            "Tesseract.from_url; it may be stuck or slower than that)")
  if "ConnectionError" in names:
    return " (no server answers at that address; is it running?)"
  return ""


def _canon(aval):
  return jax.ShapeDtypeStruct(tuple(aval.shape),
                              jax.dtypes.canonicalize_dtype(aval.dtype))


def _out_array(value, aval, what):
  value = np.asarray(value)
  if value.shape != tuple(aval.shape):
    raise TesseractEndpointError(
        f"{what} has shape {value.shape}; abstract_eval said "
        f"{tuple(aval.shape)}.")
  return value.astype(aval.dtype, copy=False)


def _host_apply(layout: _Layout, save: bool, *arrays):
  inputs = _inputs(layout, [np.asarray(a) for a in arrays])
  if save:
    inputs = {**inputs, SAVE_RESIDUALS: True}
  out = _endpoint(layout, "apply", inputs=inputs)
  where = f"Tesseract {layout.schema.where}: apply's output"
  outs = [_out_array(_get(out, s), a, f"{where} {p}") for s, a, p in
          zip(layout.out_segments, layout.out_avals, layout.out_paths)]
  if save:
    res = jax.tree_util.tree_leaves(out.get(RESIDUALS))
    if len(res) != len(layout.res_avals):
      raise TesseractEndpointError(
          f"{where} {RESIDUALS} has {len(res)} arrays; abstract_eval with "
          f"{SAVE_RESIDUALS}=True said {len(layout.res_avals)}.")
    outs += [_out_array(r, a, f"{where} {RESIDUALS}")
             for r, a in zip(res, layout.res_avals)]
  return tuple(outs)


def _host_vjp(layout: _Layout, vjp_in, vjp_out, n_res, *args):
  arrays = [np.asarray(a) for a in args[:len(layout.in_paths)]]
  rest = args[len(layout.in_paths):]
  res, cts = rest[:n_res], rest[n_res:]
  inputs = _inputs(layout, arrays)
  if n_res:
    inputs = {**inputs, RESIDUALS: jax.tree_util.tree_unflatten(
        layout.res_treedef, [np.asarray(r) for r in res])}
  out_paths = [layout.out_paths[i] for i in vjp_out]
  grads = _endpoint(layout, "vector_jacobian_product", inputs=inputs,
                    vjp_inputs=[layout.in_paths[i] for i in vjp_in],
                    vjp_outputs=out_paths,
                    cotangent_vector={p: np.asarray(c)
                                      for p, c in zip(out_paths, cts)})
  result = []
  for i in vjp_in:
    p = layout.in_paths[i]
    if p not in grads:
      raise TesseractEndpointError(
          f"Tesseract {layout.schema.where}: vector_jacobian_product "
          f"returned no cotangent for input {p} (it returned "
          f"{sorted(grads)}).")
    a = arrays[i]
    aval = jax.ShapeDtypeStruct(a.shape, a.dtype)
    result.append(_out_array(grads[p], aval,
                             f"vector_jacobian_product's cotangent of {p}"))
  return tuple(result)


def _host_jvp(layout: _Layout, jvp_in, jvp_out, *args):
  n_in = len(layout.in_paths)
  arrays = [np.asarray(a) for a in args[:n_in]]
  in_paths = [layout.in_paths[i] for i in jvp_in]
  out_paths = [layout.out_paths[j] for j in jvp_out]
  tangents = _endpoint(
      layout, "jacobian_vector_product", inputs=_inputs(layout, arrays),
      jvp_inputs=in_paths, jvp_outputs=out_paths,
      tangent_vector={p: np.asarray(t) for p, t in zip(in_paths, args[n_in:])})
  result = []
  for j, p in zip(jvp_out, out_paths):
    if p not in tangents:
      raise TesseractEndpointError(
          f"Tesseract {layout.schema.where}: jacobian_vector_product "
          f"returned no tangent for output {p} (it returned "
          f"{sorted(tangents)}).")
    result.append(_out_array(tangents[p], layout.out_avals[j],
                             f"jacobian_vector_product's tangent of {p}"))
  return tuple(result)


def _second_derivative(endpoint: str, layout: _Layout):
  return NotImplementedError(
      f"apply_tesseract: the {endpoint} endpoint of the Tesseract "
      f"{layout.schema.where} is being differentiated with respect to the "
      f"Tesseract's inputs (jax.hessian, or jax.jacfwd, jax.jacrev or "
      f"jax.jvp of a gradient): that is a second derivative, which the "
      f"Tesseract's endpoints do not give. Derivatives of a jax.vjp or "
      f"jax.linearize function with respect to its cotangents or tangents "
      f"work.")


def _callback(fn, result, args, vmap_method, endpoint, layout):
  """``fn`` on the host (``jax.pure_callback``); differentiating it raises
  at trace time, naming the endpoint (JAX's own message does not)."""
  op = jax.custom_jvp(lambda *a: jax.pure_callback(
      fn, result, *a, vmap_method=vmap_method))

  def refuse(primals, tangents):
    raise _second_derivative(endpoint, layout)
  op.defjvp(refuse, symbolic_zeros=True)
  return op(*args)


def _host_jacobian(layout: _Layout, jac_in, jac_out, *arrays):
  arrays = [np.asarray(a) for a in arrays]
  in_paths = [layout.in_paths[i] for i in jac_in]
  out_paths = [layout.out_paths[j] for j in jac_out]
  jac = _endpoint(layout, "jacobian", inputs=_inputs(layout, arrays),
                  jac_inputs=in_paths, jac_outputs=out_paths)
  blocks = []
  for j, po in zip(jac_out, out_paths):
    for i, pi in zip(jac_in, in_paths):
      try:
        block = jac[po][pi]
      except (KeyError, TypeError):
        raise TesseractEndpointError(
            f"Tesseract {layout.schema.where}: jacobian returned no block "
            f"for output {po} and input {pi}.") from None
      shape = tuple(layout.out_avals[j].shape) + np.shape(arrays[i])
      blocks.append(_out_array(block, jax.ShapeDtypeStruct(
          shape, layout.out_avals[j].dtype), f"jacobian's block ({po}, {pi})"))
  return tuple(blocks)


def _jacobian_blocks(layout: _Layout, vals, jac_in, jac_out, vmap_method):
  """``{(j, i): d out_j / d in_i}`` (output shape + input shape), from one
  call of the ``jacobian`` endpoint."""
  result = tuple(jax.ShapeDtypeStruct(
      tuple(layout.out_avals[j].shape) + tuple(vals[i].shape),
      layout.out_avals[j].dtype) for j in jac_out for i in jac_in)
  blocks = _callback(lambda *a: _host_jacobian(layout, jac_in, jac_out, *a),
                     result, vals, vmap_method, "jacobian", layout)
  pairs = [(j, i) for j in jac_out for i in jac_in]
  return dict(zip(pairs, blocks))


def _linear_in(fn, n_fixed: int, endpoint: str, layout: _Layout):
  """``fn(*fixed, *linear)``, linear in ``linear``, differentiable as such:
  its JVP in ``linear`` is ``fn`` again on the tangents (``jax.jvp`` of a
  ``jax.vjp`` function or of a ``jax.linearize`` one); a tangent on a
  ``fixed`` argument (primal inputs, residuals) would need a second
  derivative, which no endpoint gives, and raises at trace time."""
  op = jax.custom_jvp(fn)

  def rule(primals, tangents):
    if any(not isinstance(t, SymbolicZero) for t in tangents[:n_fixed]):
      raise _second_derivative(endpoint, layout)
    out = op(*primals)
    lin = tangents[n_fixed:]
    if all(isinstance(t, SymbolicZero) for t in lin):
      return out, tuple(jnp.zeros_like(o) for o in out)
    lin = [jnp.zeros(t.shape, t.dtype) if isinstance(t, SymbolicZero) else t
           for t in lin]
    return out, op(*primals[:n_fixed], *lin)
  op.defjvp(rule, symbolic_zeros=True)
  return op


def _linear(layout: _Layout, vmap_method, materialize, endpoint, host, n_per,
            result, args, from_jacobian):
  """The ``endpoint``'s callback ``host`` on ``args`` (the first ``n_per``
  per primal, the rest tangents or cotangents), linear in the latter. Under
  ``vmap`` with only the tangents or cotangents mapped (``jax.jacfwd``,
  ``jax.jacrev``), where the Tesseract has a ``jacobian`` endpoint, does not
  batch itself and ``materialize`` is not False, one ``jacobian`` call
  serves the batch: ``from_jacobian(per_primal, linear)`` contracts it with
  the mapped arguments (axis 0)."""
  def plain(*a):
    return _callback(host, result, a, vmap_method, endpoint, layout)
  if (vmap_method != "sequential" or materialize is False
      or "jacobian" not in layout.schema.endpoints):
    return _linear_in(plain, n_per, endpoint, layout)(*args)

  op = jax.custom_batching.custom_vmap(plain)

  def batched(axis_size, in_batched, *a):
    if not any(in_batched[:n_per]):
      linear = [x if b else jnp.broadcast_to(x, (axis_size, *np.shape(x)))
                for x, b in zip(a[n_per:], in_batched[n_per:])]
      outs = from_jacobian(a[:n_per], linear)
    else:
      outs = jax.vmap(plain, in_axes=[0 if b else None for b in in_batched],
                      axis_size=axis_size)(*a)
    return tuple(outs), (True,) * len(outs)
  op.def_vmap(batched)
  return _linear_in(op, n_per, endpoint, layout)(*args)


def _contract(x, block, lead: int, trailing: bool):
  """``x`` (batch axis 0, then its own axes) contracted with ``block`` over
  ``block``'s trailing (``trailing``) or leading axes that ``x``'s own
  match; ``lead``: how many of ``block``'s axes stay on the other side."""
  n = x.ndim - 1
  axes_b = (list(range(lead, lead + n)) if trailing else list(range(n)))
  return jnp.tensordot(x, block, axes=(list(range(1, n + 1)), axes_b))


def _build(layout: _Layout, vmap_method: str, materialize):
  n_in = len(layout.in_paths)

  def f(*arrays):
    return _callback(lambda *a: _host_apply(layout, False, *a),
                     layout.out_avals, arrays, vmap_method, "apply", layout)

  def values(primals):
    vals = tuple(jnp.asarray(p.value) for p in primals)
    perturbed = tuple(bool(p.perturbed) for p in primals)
    check_differentiable(perturbed)
    return vals, perturbed

  def check_differentiable(perturbed):
    for i, pert in enumerate(perturbed):
      if pert and not layout.in_diff[i]:
        raise ValueError(
            f"apply_tesseract: input {layout.in_paths[i]} of the Tesseract at "
            f"{layout.schema.where} is being differentiated, but its schema "
            f"does not mark it Differentiable; differentiate with respect to "
            f"the differentiable inputs only "
            f"({', '.join(layout.schema.diff_inputs) or 'none'}), or pass this "
            f"one through jax.lax.stop_gradient.")

  def fwd(*primals):
    vals, perturbed = values(primals)
    if not layout.schema.contract:
      return f(*vals), (vals, (), perturbed)
    outs = _callback(lambda *a: _host_apply(layout, True, *a),
                     (*layout.out_avals, *layout.res_avals), vals, vmap_method,
                     "apply", layout)
    k = len(layout.out_avals)
    return tuple(outs[:k]), (vals, tuple(outs[k:]), perturbed)

  def vjp(vals, res, perturbed, g):
    vjp_in = [i for i in range(n_in) if perturbed[i] and layout.in_diff[i]]
    vjp_out = []
    for j, ct in enumerate(g):
      if isinstance(ct, SymbolicZero):
        continue
      if not layout.out_diff[j]:
        raise ValueError(
            f"apply_tesseract: output {layout.out_paths[j]} of the Tesseract "
            f"{layout.schema.where} receives a cotangent, but its schema "
            f"does not mark it Differentiable; wrap it in "
            f"jax.lax.stop_gradient before it reaches the loss.")
      vjp_out.append(j)
    if not vjp_in or not vjp_out:
      return (None,) * n_in
    result = tuple(jax.ShapeDtypeStruct(vals[i].shape, vals[i].dtype)
                   for i in vjp_in)
    def from_jacobian(per, cts):
      blocks = _jacobian_blocks(layout, per[:n_in], vjp_in, vjp_out,
                                vmap_method)
      return [sum(_contract(ct, blocks[j, i], 0, trailing=False)
                  for j, ct in zip(vjp_out, cts)) for i in vjp_in]

    grads = _linear(
        layout, vmap_method, materialize, "vector_jacobian_product",
        lambda *a: _host_vjp(layout, vjp_in, vjp_out, len(res), *a),
        n_in + len(res), result, (*vals, *res, *(g[j] for j in vjp_out)),
        from_jacobian)
    out = [None] * n_in
    for i, gi in zip(vjp_in, grads):
      out[i] = gi
    return tuple(out)

  def bwd(residuals, g):
    vals, res, perturbed = residuals
    return vjp(vals, res, perturbed, g)

  def fwd_bwd(*args):
    vals, perturbed = values(args[:-1])
    return vjp(vals, (), perturbed, args[-1])

  def jvp(primals, tangents):
    # forward mode: apply for the primal outputs (removed where only the
    # tangents are needed: linearize, jacfwd) and the JVP endpoint for the
    # perturbed inputs and differentiable outputs
    perturbed = tuple(not isinstance(t, SymbolicZero) for t in tangents)
    check_differentiable(perturbed)
    if "jacobian_vector_product" not in layout.schema.endpoints:
      raise NotImplementedError(
          f"Tesseract {layout.schema.where} has no jacobian_vector_product "
          f"endpoint, which forward mode (jax.jvp, jax.linearize, "
          f"jax.jacfwd) needs; its endpoints: "
          f"{', '.join(sorted(layout.schema.endpoints))}.")
    vals = tuple(jnp.asarray(p) for p in primals)
    out = f(*vals)
    jvp_in = [i for i in range(n_in) if perturbed[i]]
    jvp_out = [j for j, d in enumerate(layout.out_diff) if d]
    tangent_out = [jnp.zeros(a.shape, a.dtype) for a in layout.out_avals]
    if jvp_in and jvp_out:
      def from_jacobian(per, ts):
        blocks = _jacobian_blocks(layout, per, jvp_in, jvp_out, vmap_method)
        return [sum(_contract(t, blocks[j, i], len(layout.out_avals[j].shape),
                              trailing=True)
                    for i, t in zip(jvp_in, ts)) for j in jvp_out]

      touts = _linear(
          layout, vmap_method, materialize, "jacobian_vector_product",
          lambda *a: _host_jvp(layout, jvp_in, jvp_out, *a), n_in,
          tuple(layout.out_avals[j] for j in jvp_out),
          (*vals, *(tangents[i] for i in jvp_in)), from_jacobian)
      for j, t in zip(jvp_out, touts):
        tangent_out[j] = t
    return out, tuple(tangent_out)

  call = smart_custom_vjp(f)
  call.defvjp(fwd, bwd, symbolic_zeros=True, fwd_bwd=fwd_bwd, jvp=jvp)
  return call


# -- the public function -------------------------------------------------------

def _array_leaf(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))   # tracers too


def _abstract_eval(tesseract, schema, abstract):
  try:
    return tesseract.abstract_eval(abstract)
  except Exception as e:  # noqa: BLE001 - re-raised with address and inputs
    raise TesseractEndpointError(
        f"Tesseract {schema.where}: endpoint abstract_eval failed on the "
        f"given inputs (shapes and dtypes {abstract}): "
        f"{type(e).__name__}: {e}") from e


def apply_tesseract(tesseract: Tesseract, inputs: Any, *,
                    vmap_method: str | None = None,
                    materialize_jacobian: bool | None = None,
                    check_static_outputs: bool | None = None) -> Any:
  """The Tesseract's ``apply`` on ``inputs``, differentiable through JAX.

  Args:
    tesseract: a ``tesseract_core.Tesseract`` (``from_tesseract_api``,
      ``from_url``, ``from_image``); it needs the ``abstract_eval`` endpoint,
      ``vector_jacobian_product`` for reverse mode and
      ``jacobian_vector_product`` for forward mode. A served one should be
      made with a ``timeout`` (``Tesseract.from_url(url, timeout=60)``):
      without one, a server that stops answering makes the program wait
      for ever.
    inputs: the inputs of ``apply`` as a nested dict/list, as the Tesseract's
      input schema has them. JAX and numpy arrays (traced or not) are
      operands; other leaves (str, int, bool, float) are static, except a
      Python number where the schema has a differentiable array, which is
      made an array. Traced arrays the schema does not mark differentiable
      are accepted; differentiating them raises.
    vmap_method: how ``jax.vmap`` maps the endpoints: ``"sequential"`` (one
      call per example), ``"expand_dims"`` or ``"broadcast_all"`` (one call
      on batched arrays; the Tesseract must accept them); ``None``,
      ``"auto"`` or ``"auto_experimental"`` (default): ``"expand_dims"``
      when every differentiable array of the schema has an ellipsis shape
      (``Array[..., dtype]``), else ``"sequential"``.
    materialize_jacobian: ``None`` (default) or ``True``: where only the
      tangents or cotangents are mapped by ``vmap`` (``jax.jacfwd``,
      ``jax.jacrev``, ``vmap`` of a ``jax.vjp`` or ``jax.linearize``
      function), the vmap method is sequential and the Tesseract has a
      ``jacobian`` endpoint, one ``jacobian`` call serves the whole batch;
      ``False``: one JVP or VJP call per example instead.
    check_static_outputs: accepted for tesseract-jax compatibility; static
      outputs are always the ones ``abstract_eval`` reports.

  Returns:
    ``apply``'s outputs with the output schema's structure: arrays with the
    shapes ``abstract_eval`` reports (dtypes canonicalized by JAX, so float64
    needs ``jax_enable_x64``), and the non-array outputs as ``abstract_eval``
    reports them.

  ``abstract_eval`` runs once per Tesseract object and input structure (the
  input pytree, its static leaves, the arrays' shapes and dtypes): later
  calls and traces with the same structure reuse its answer.

  Raises:
    TypeError: ``tesseract`` is not a Tesseract.
    ValueError: an unknown ``vmap_method``; differentiating an input the
      schema does not mark differentiable, or a cotangent reaching such an
      output (at trace time, before any endpoint runs).
    NotImplementedError: the Tesseract lacks an endpoint a transformation
      needs (``abstract_eval`` always; ``vector_jacobian_product`` for
      gradients; ``jacobian_vector_product`` for forward mode); a second
      derivative (``jax.hessian``, ``jax.jacfwd`` of a gradient), which no
      endpoint gives (at trace time).
    TesseractEndpointError: an endpoint failed (its message, the endpoint
      and the address; a served Tesseract that is down or exceeds its
      ``timeout`` is one); raised by ``abstract_eval`` at trace time, and
      inside JAX's ``JaxRuntimeError`` for endpoints that run in the
      compiled program.
  """
  del check_static_outputs
  if not isinstance(tesseract, Tesseract):
    raise TypeError("apply_tesseract: the first argument must be a "
                    "tesseract_core.Tesseract, got "
                    f"{type(tesseract).__name__}.")
  if vmap_method is None:
    vmap_method = "auto"
  if vmap_method not in _VMAP_METHODS:
    raise ValueError(f"apply_tesseract: vmap_method must be one of "
                     f"{_VMAP_METHODS} or None, got {vmap_method!r}.")
  schema = _schema(tesseract)
  if "abstract_eval" not in schema.endpoints:
    raise NotImplementedError(
        f"apply_tesseract: the Tesseract {schema.where} has no "
        "abstract_eval endpoint; it is needed for the shapes and dtypes of "
        "apply's outputs.")
  if vmap_method.startswith("auto"):
    vmap_method = "expand_dims" if schema.batches_itself else "sequential"

  flat, treedef = jax.tree_util.tree_flatten_with_path(inputs)
  leaves, arrays, paths, diff, abstract_leaves, key = [], [], [], [], [], []
  for keypath, x in flat:
    path, is_diff = _path(_segments(keypath), schema.diff_inputs)
    if is_diff and isinstance(x, (int, float)) and not isinstance(x, bool):
      x = jnp.asarray(x)
    if _array_leaf(x):
      leaves.append(_ARRAY)
      arrays.append(x)
      paths.append(path)
      diff.append(is_diff)
      shape, dtype = tuple(np.shape(x)), str(np.dtype(x.dtype))
      abstract_leaves.append({"shape": list(shape), "dtype": dtype})
      key.append((shape, dtype))
    else:
      leaves.append(x)
      abstract_leaves.append(x)
      key.append((type(x), x))
  abstract = jax.tree_util.tree_unflatten(treedef, abstract_leaves)
  answers = _cached(tesseract, (treedef, tuple(key)),
                    lambda: _ask(tesseract, schema, abstract))
  layout = _layout(tesseract, schema, treedef, leaves, paths, diff, *answers)
  call = _build(layout, vmap_method, materialize_jacobian)
  out_static = layout.out_static
  out_treedef = layout.out_treedef
  outs = iter(call(*arrays))
  out_leaves = [next(outs) if s is _ARRAY else s for s in out_static]
  # a static output that abstract_eval reports as a residual slot is dropped
  return jax.tree_util.tree_unflatten(out_treedef, out_leaves)


# -- abstract_eval, once per input structure -----------------------------------

_ANSWERS: "weakref.WeakKeyDictionary[Tesseract, collections.OrderedDict]" = (
    weakref.WeakKeyDictionary())
_ANSWERS_PER_TESSERACT = 128


def _cached(tesseract, key, ask):
  """``ask()``'s answer, kept per Tesseract object and input structure
  ``key`` (the last ``_ANSWERS_PER_TESSERACT`` structures), and asked afresh
  where the key or the Tesseract cannot be kept. The answers are
  ``abstract_eval``'s data, which holds no reference to the Tesseract: they
  go with it."""
  try:
    hash(key)
    per = _ANSWERS.setdefault(tesseract, collections.OrderedDict())
  except TypeError:   # an unhashable static leaf, or no weak reference
    return ask()
  try:
    per.move_to_end(key)
    return per[key]
  except KeyError:
    pass
  value = per[key] = ask()
  while len(per) > _ANSWERS_PER_TESSERACT:
    per.popitem(last=False)
  return value


def _ask(tesseract, schema, abstract):
  """``abstract_eval`` on ``abstract``: (its answer, the residuals' part of
  its answer with the contract's flag set, or None without the contract)."""
  out_abstract = _abstract_eval(tesseract, schema, abstract)
  if not schema.contract:
    return out_abstract, None
  with_res = _abstract_eval(tesseract, schema,
                            {**abstract, SAVE_RESIDUALS: True})
  return out_abstract, with_res.get(RESIDUALS)


def _layout(tesseract, schema, treedef, leaves, paths, diff, out_abstract,
            res_abstract) -> _Layout:
  """One call's layout, from ``abstract_eval``'s answers (``_ask``)."""
  out_flat, out_treedef = jax.tree_util.tree_flatten_with_path(
      out_abstract, is_leaf=_is_aval)
  out_static, out_segments, out_paths, out_diff, out_avals = [], [], [], [], []
  for keypath, leaf in out_flat:
    if _is_aval(leaf):
      segs = _segments(keypath)
      if schema.contract and segs and segs[0] == ("key", RESIDUALS):
        out_static.append(None)   # the contract's slot: only with the flag
        continue
      p, d = _path(segs, schema.diff_outputs)
      out_static.append(_ARRAY)
      out_segments.append(tuple(segs))
      out_paths.append(p)
      out_diff.append(d)
      out_avals.append(_canon(jax.ShapeDtypeStruct(tuple(leaf["shape"]),
                                                   np.dtype(leaf["dtype"]))))
    else:
      out_static.append(leaf)

  res_treedef, res_avals = None, []
  if schema.contract:
    res_leaves, res_treedef = jax.tree_util.tree_flatten(res_abstract,
                                                         is_leaf=_is_aval)
    res_avals = [_canon(jax.ShapeDtypeStruct(tuple(a["shape"]),
                                             np.dtype(a["dtype"])))
                 for a in res_leaves]
  return _Layout(tesseract, schema, treedef, tuple(leaves), tuple(paths),
                 tuple(diff), out_treedef, tuple(out_static),
                 tuple(out_segments), tuple(out_paths), tuple(out_diff),
                 tuple(out_avals), res_treedef, tuple(res_avals))


# -- for Tesseract authors: the residual contract in a few lines ---------------

class ResidualContractError(ValueError):
  """A Tesseract does not keep the residual contract; the message says which
  part (a field, ``abstract_eval``'s declaration, ``apply``'s outputs, the
  VJP from residuals) and what differs."""


def contract_schemas(residuals_type: Any) -> tuple[type, type]:
  """Base classes that add the residual contract's fields to a Tesseract.

  ``residuals_type`` is the type of what ``apply`` keeps for its adjoint, as
  tesseract-core writes array types (``Array[(None, None), Float64]``, or a
  dict or model of them). Returns ``(Inputs, Outputs)``, pydantic models to
  derive the ``tesseract_api.py``'s ``InputSchema`` and ``OutputSchema``
  from: ``Inputs`` has ``save_residuals: bool = False`` and
  ``residuals: residuals_type | None = None``, ``Outputs`` has
  ``residuals: residuals_type | None = None``. The endpoints then read
  ``inputs.save_residuals`` (``apply``: also return them) and
  ``inputs.residuals`` (``vector_jacobian_product``: use them when not
  ``None``), and ``abstract_eval`` returns :func:`with_residuals`'s result.
  A client that does not know the contract (tesseract-jax) sees two
  optional fields it never sets.

  The ``tesseract_api.py`` then imports smartvjp (and so JAX) where it runs;
  a Tesseract that should not can write the three fields itself (the
  contract is only their names and meaning).
  """
  import typing  # pylint: disable=import-outside-toplevel

  import pydantic  # pylint: disable=import-outside-toplevel
  maybe = typing.Optional[residuals_type]
  inputs = pydantic.create_model(
      "ResidualContractInputs",
      save_residuals=(bool, pydantic.Field(
          default=False, description="smartvjp residual contract: apply also "
          "returns what its adjoint needs, as `residuals`")),
      residuals=(maybe, pydantic.Field(
          default=None, description="smartvjp residual contract: what an "
          "earlier apply with save_residuals returned; the VJP uses it "
          "instead of re-running the forward")))
  outputs = pydantic.create_model(
      "ResidualContractOutputs",
      residuals=(maybe, pydantic.Field(
          default=None, description="smartvjp residual contract: what the "
          "adjoint needs (only with save_residuals)")))
  return inputs, outputs


def with_residuals(abstract_inputs: Any, outputs: dict,
                   residuals: Any) -> dict:
  """``abstract_eval``'s answer under the residual contract: ``outputs``
  (the output shapes and dtypes, ``{"shape": [...], "dtype": "..."}``
  leaves) with ``residuals`` (the same, for what ``apply`` keeps) in the
  ``residuals`` field when ``abstract_inputs.save_residuals`` is set, else
  ``None`` there."""
  keep = bool(getattr(abstract_inputs, SAVE_RESIDUALS, False))
  return {**outputs, RESIDUALS: residuals if keep else None}


def check_residual_contract(tesseract: Tesseract, inputs: dict, *,
                            rtol: float = 1e-12, seed: int = 0) -> None:
  """Checks that a Tesseract keeps the residual contract, on ``inputs``
  (concrete numpy or JAX arrays; a dict as ``apply`` takes it).

  Runs ``apply`` without and with ``save_residuals``, ``abstract_eval`` with
  it, and ``vector_jacobian_product`` for every differentiable input and
  output with seeded random cotangents, without and with the residuals, and
  compares: the outputs equal, the plain ``apply`` returns no residuals, the
  residuals have the shapes and dtypes ``abstract_eval`` declares, and the
  two VJPs agree to ``rtol``. Meant for a Tesseract's own tests.

  Raises:
    ResidualContractError: the schema lacks a field of the contract, or any
      comparison fails (the message names the output, input or residual).
    TesseractEndpointError: an endpoint failed.
  """
  schema = _schema(tesseract)
  where = f"Tesseract {schema.where}"
  if not schema.contract:
    raise ResidualContractError(
        f"{where}: its schema does not declare the residual contract (inputs "
        f"`{SAVE_RESIDUALS}` and `{RESIDUALS}`, output `{RESIDUALS}`); "
        f"derive InputSchema and OutputSchema from contract_schemas(...).")

  def flat(tree, templates):
    out = {}
    for keypath, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
      path, is_diff = _path(_segments(keypath), templates)
      if is_diff:
        out[path] = np.asarray(x)
    return out

  plain = _call_endpoint(tesseract, schema, "apply", inputs=inputs)
  saved = _call_endpoint(tesseract, schema, "apply",
                         inputs={**inputs, SAVE_RESIDUALS: True})
  if plain.get(RESIDUALS) is not None:
    raise ResidualContractError(
        f"{where}: apply without {SAVE_RESIDUALS} returned {RESIDUALS}; it "
        f"should return None there (they would travel for nothing).")
  res = saved.get(RESIDUALS)
  if res is None:
    raise ResidualContractError(
        f"{where}: apply with {SAVE_RESIDUALS}=True returned no {RESIDUALS}.")
  without = {k: v for k, v in plain.items() if k != RESIDUALS}
  with_ = {k: v for k, v in saved.items() if k != RESIDUALS}
  a_leaves = jax.tree_util.tree_flatten_with_path(without)[0]
  b_leaves = jax.tree_util.tree_flatten_with_path(with_)[0]
  if [k for k, _ in a_leaves] != [k for k, _ in b_leaves]:
    raise ResidualContractError(
        f"{where}: apply's outputs differ in structure with and without "
        f"{SAVE_RESIDUALS}.")
  for (k, a), (_, b) in zip(a_leaves, b_leaves):
    if not np.array_equal(np.asarray(a), np.asarray(b)):
      raise ResidualContractError(
          f"{where}: apply's output {_path(_segments(k), ())[0]} differs with "
          f"{SAVE_RESIDUALS}=True; the flag may only add {RESIDUALS}.")

  def abstract(keypath, x):
    _, is_diff = _path(_segments(keypath), schema.diff_inputs)
    if is_diff and isinstance(x, (int, float)) and not isinstance(x, bool):
      x = np.asarray(x)
    if _array_leaf(x):
      return {"shape": list(np.shape(x)), "dtype": str(np.dtype(x.dtype))}
    return x
  declared = _abstract_eval(tesseract, schema, {
      **jax.tree_util.tree_map_with_path(abstract, inputs),
      SAVE_RESIDUALS: True})
  want = jax.tree_util.tree_flatten(declared.get(RESIDUALS),
                                    is_leaf=_is_aval)
  got = jax.tree_util.tree_flatten(res)
  if want[1] != got[1]:
    raise ResidualContractError(
        f"{where}: abstract_eval with {SAVE_RESIDUALS}=True declares "
        f"{RESIDUALS} {declared.get(RESIDUALS)}; apply returned a different "
        f"structure ({got[1]}).")
  for i, (w, g) in enumerate(zip(want[0], got[0])):
    g = np.asarray(g)
    if (tuple(w["shape"]) != g.shape
        or np.dtype(w["dtype"]) != g.dtype):
      raise ResidualContractError(
          f"{where}: {RESIDUALS} leaf {i} has shape {g.shape} and dtype "
          f"{g.dtype}; abstract_eval declares {w}.")

  rng = np.random.default_rng(seed)
  outs = flat(without, schema.diff_outputs)
  cts = {p: rng.normal(size=np.shape(v)).astype(np.asarray(v).dtype)
         for p, v in outs.items()}
  ins = sorted(flat(inputs, schema.diff_inputs))
  kw = dict(vjp_inputs=ins, vjp_outputs=sorted(cts), cotangent_vector=cts)
  ref = _call_endpoint(tesseract, schema, "vector_jacobian_product",
                       inputs=inputs, **kw)
  from_res = _call_endpoint(tesseract, schema, "vector_jacobian_product",
                       inputs={**inputs, RESIDUALS: res}, **kw)
  for p in ins:
    a, b = np.asarray(ref.get(p)), np.asarray(from_res.get(p))
    if a.shape != b.shape or not np.allclose(b, a, rtol=rtol, atol=0):
      raise ResidualContractError(
          f"{where}: vector_jacobian_product's cotangent of {p} differs "
          f"given {RESIDUALS} (max difference "
          f"{np.max(np.abs(b - a)) if a.shape == b.shape else 'shape'}); the "
          f"VJP from residuals must equal the plain one.")
