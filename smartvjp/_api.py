"""The user API: ``smart_custom_vjp``, a drop-in for ``jax.custom_vjp``."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Sequence

from jax import tree_util
from jax.errors import UnexpectedTracerError

from smartvjp import _facade as jx
from smartvjp import _jax_api
from smartvjp import _versions
from smartvjp._cache import TraceLocalCache
from smartvjp._checks import check_aliased_arguments, function_name, rule_error
from smartvjp._forward import JvpRule
from smartvjp._primitive import call_p
from smartvjp._spec import Rules, Unprocessed

_CACHE_SIZE = 256


class smart_custom_vjp:
  """A ``jax.custom_vjp`` whose forward pass under remat runs ``f``, not ``fwd``.

  Decorate the primal ``f``, then give its rules with ``defvjp``, as with
  ``jax.custom_vjp``. The difference shows under ``jax.checkpoint`` (remat):
  ``jax.custom_vjp`` runs ``fwd`` in the forward pass, drops its residuals
  and runs ``fwd`` again in the backward pass, so ``f`` never runs
  (jax-ml/jax#21303); here the forward pass runs ``f`` and the backward pass
  runs ``fwd`` once (or the fused ``fwd_bwd`` rule, if given, where it costs
  no more: ``defvjp``'s ``fused``). Example
  (self-contained; it runs as written):

  ```python
  import jax
  import jax.numpy as jnp
  from smartvjp import smart_custom_vjp

  @smart_custom_vjp
  def f(x, w):                  # the primal: returns only the output
    return jnp.tanh(x @ w)

  def f_fwd(x, w):              # the output and the residuals bwd needs
    z = jnp.tanh(x @ w)
    return z, (x, w, z)

  def f_bwd(res, g):            # one cotangent per argument of f
    x, w, z = res
    dy = g * (1 - z ** 2)
    return dy @ w.T, x.T @ dy

  def f_fwd_bwd(x, w, g):       # optional fused rule: bwd's result from
    z = jnp.tanh(x @ w)         # the arguments, keeping no residuals
    dy = g * (1 - z ** 2)
    return dy @ w.T, x.T @ dy

  f.defvjp(f_fwd, f_bwd, fwd_bwd=f_fwd_bwd)

  def loss(x, w):
    return jnp.sum(jax.checkpoint(f)(x, w) ** 2)

  x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
  w = jnp.linspace(0.5, -0.5, 6).reshape(3, 2)
  dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
  # forward pass: f; backward pass: f_fwd_bwd (f_fwd then f_bwd without it)
  ```

  Args:
    fun: the primal function ``f(*args) -> out``. Its differentiable
      arguments and its output are pytrees of arrays (any shapes and
      dtypes; integer inputs get ``float0`` cotangents, as in JAX).
    nondiff_argnums: positions of arguments that are not differentiated
      (functions, other Python values, hashable or not; never tracers).
      ``bwd`` receives them first, as in ``jax.custom_vjp``; ``fwd`` and
      ``fwd_bwd`` receive them in their places.
    nondiff_argnames: the same, by parameter name; a name that is not a
      parameter of ``fun`` is ignored, as ``jax.custom_vjp`` ignores it.

  What runs where, per call site:

  * Evaluation, under ``jit`` or not: ``f`` only; ``fwd`` and ``bwd`` are
    not traced.
  * ``jax.grad``/``jax.vjp`` without remat: ``fwd``, then ``bwd`` in the
    backward pass. Where they apply directly to the call (eagerly, inside
    ``jit``, under ``vmap``, or over one or nested ``vmap``s of it), ``f``
    is not traced, as with ``jax.custom_vjp``: Python code in ``f`` that
    needs concrete values (``if x > 0:``) works under eager ``jax.grad``.
  * Under ``jax.checkpoint`` with a policy that saves nothing ``fwd``
    computes (the default): ``f`` in the forward pass; ``fwd`` then ``bwd``
    (or ``fwd_bwd``, if given) in the rematerialized backward region. A
    residual that is just an input of the call is never recomputed, so a
    ``fwd`` whose residuals are all inputs runs in neither pass (``f``
    forward, ``bwd`` backward; ``fwd`` is traced, to find that out).
  * Under ``jax.checkpoint`` with a policy that saves everything ``fwd``
    computes (``everything_saveable``, or ``save_only_these_names`` naming
    every residual): ``fwd`` in the forward pass, only ``bwd`` in the
    backward pass; ``f`` does not run.
  * A policy that saves some of what a JAX-coded ``fwd`` computes splits
    ``fwd`` equation by equation, as ``jax.checkpoint`` splits code
    inlined in it: the part that computes the saved values runs in the
    forward pass, the rest in the backward region before ``bwd``; ``f``
    does not run. A ``fwd`` whose work is one opaque kernel (a Pallas call,
    a custom call, a callback) cannot be split and is recomputed whole
    (``f`` forward, ``fwd`` backward); so is a JAX-coded ``fwd`` where an
    estimate of the operations (matrix products by multiply-adds, others by
    output size) finds the split no cheaper. Either way no kernel runs more
    often than with ``jax.custom_vjp``.

  ``f`` runs (is traced) where it runs with ``jax.custom_vjp``: plain calls,
  ``jit(F)``, staged bodies (``scan``, ``cond``, ``jax.checkpoint``), and
  in addition in the forward pass under remat.

  How a policy decides: each residual ``fwd`` computes is saveable if the
  policy says so for the equation of ``fwd``'s jaxpr producing it (a
  ``jax.ad_checkpoint.checkpoint_name(r, name)`` makes that the name, so
  ``save_only_these_names`` works; a ``dot_general`` output is saveable
  under ``dots_saveable``; a kernel's output is not) or for the call itself
  (``everything_saveable`` saves, ``nothing_saveable`` recomputes).

  Where it differs from ``jax.custom_vjp`` (the full list, with reasons, is
  ``design/limitations.md`` in the source repository and on the
  documentation site; it is not installed with the package):

  * Where smartvjp runs ``f`` in ``fwd``'s place (the forward pass under
    remat; under ``jit``, where ``f`` is traced anyway, as in a staged
    body, a ``fwd`` whose residuals are all inputs or a call that no
    cotangent reaches) the forward value is ``f``'s, where
    ``jax.custom_vjp``'s is ``fwd``'s: keep ``f`` and ``fwd``'s primal
    output equal; ``smartvjp.check_primals`` checks it under remat.
  * Within one traced program (``jit``, ``make_jaxpr``) each rule is traced
    once per signature (argument structure, shapes, dtypes and nondiff
    values) and reused by every call with that signature; each new program
    traces the rules again, so Python state they read while traced (a
    global, a mutable closure) is read afresh, as with ``jax.custom_vjp``.
    Eager ``jax.grad``/``jax.vjp`` run ``fwd`` and ``bwd`` on concrete
    values at each call.
  * Differentiating only values that ``f`` closes over (none of its
    arguments) differentiates ``f`` itself, where ``jax.custom_vjp``
    raises.
  * ``optimize_remat`` is accepted and ignored (the behaviour is always on).
  * Beyond ``jax.custom_vjp``: forward mode (``jax.jvp``, ``jax.jacfwd``,
    ``jax.linearize``) transposes ``g -> bwd(res, g)``, so ``bwd`` must be
    JAX code linear in ``g`` (an opaque ``bwd`` raises ``TypeError``; a
    nonlinear one is not detected); higher-order derivatives under remat
    differentiate the rules themselves, so they must be differentiable.
  """

  def __init__(self, fun: Callable[..., Any],
               nondiff_argnums: Sequence[int] = (),
               nondiff_argnames: Sequence[str] = ()):
    """Wraps ``fun``; see the class help for the arguments. ``defvjp`` must be
    called before the wrapper is."""
    functools.update_wrapper(self, fun)
    self.fun = fun
    argnums = set(nondiff_argnums)
    if nondiff_argnames:
      params = list(inspect.signature(fun).parameters)
      # as jax.custom_vjp: a name fun does not have is ignored
      argnums.update(params.index(n) for n in nondiff_argnames if n in params)
    self.nondiff_argnums = tuple(sorted(argnums))
    self.fwd: Callable | None = None
    self.bwd: Callable | None = None
    self.fwd_bwd: Callable | None = None
    self.symbolic_zeros = False
    self.optimize_remat = False
    self.generic_batching = False
    self._jvp = None
    self._rules: Rules | None = None
    self._cache = TraceLocalCache(_CACHE_SIZE)

  def __getattr__(self, name):
    """Attributes that the wrapper lacks are looked up on ``fun``."""
    if name in ("fun", "__wrapped__"):
      raise AttributeError(name)
    return getattr(self.fun, name)

  def defvjp(self, fwd: Callable | None = None, bwd: Callable | None = None,
             symbolic_zeros: bool = False, optimize_remat: bool = False,
             generic_batching: bool | None = None, *,
             fwd_bwd: Callable | None = None,
             jvp: Callable | None = None,
             fused: bool | None = None) -> None:
    """Defines the rules; the signature of ``jax.custom_vjp.defvjp`` +
    ``fwd_bwd`` and ``jvp``.

    Give ``fwd`` and ``bwd``, or ``fwd_bwd`` alone, or all three; ``jvp``
    may be added to any of these.

    Args:
      fwd: ``fwd(*args) -> (out, residuals)``, all arguments in their places
        (nondiff ones included). ``out`` has ``f``'s output structure, shapes
        and dtypes; ``residuals`` is any pytree of JAX arrays.
      bwd: ``bwd(*nondiff_args, residuals, g) -> tuple`` with one cotangent
        pytree (or ``None``) per differentiable argument, shaped like it;
        ``g`` has the structure of ``f``'s output.
      symbolic_zeros: as in ``jax.custom_vjp``: ``fwd`` and ``fwd_bwd``
        receive ``jax.custom_derivatives.CustomVJPPrimal`` leaves (with
        ``.value`` and ``.perturbed``), and ``bwd``/``fwd_bwd`` may receive
        ``jax.custom_derivatives.SymbolicZero`` cotangents.
      optimize_remat: accepted for drop-in compatibility; it changes nothing
        (smartvjp's remat behaviour is always on).
      generic_batching: only where ``jax.custom_vjp.defvjp`` has it (jax
        0.12), with its meaning: under ``vmap``, an output that ``f``
        computes from unmapped inputs only stays unmapped even when ``fwd``
        maps it (it takes the first example's value, and its whole
        cotangent goes to the first example's ``bwd``). ``None`` (the
        default, which any jax accepts) or ``False``: when the call is
        differentiated, ``fwd``'s mapping decides, as for the classic
        ``jax.custom_vjp``.
      fwd_bwd: optional fused rule ``fwd_bwd(*args, g) -> tuple`` returning
        what ``bwd`` returns, recomputing what it needs from the arguments
        (all in their places). Used in the rematerialized backward region
        instead of ``fwd`` + ``bwd``, and everywhere when ``fwd`` and ``bwd``
        are not given. It must return what ``bwd(fwd(*args)[1], g)``
        returns: a ``fwd_bwd`` that disagrees changes the gradient under
        ``jax.checkpoint`` only; ``smartvjp.check_primals`` compares the
        two where ``fwd_bwd`` runs and all three are given.
      jvp: optional forward rule ``jvp(*nondiff_args, primals, tangents) ->
        (primal_out, tangent_out)``, with the signature of a
        ``jax.custom_jvp`` rule: ``primals`` and ``tangents`` are tuples of
        the differentiable arguments and their tangents (zeros where an
        argument has none: ``jax.custom_derivatives.SymbolicZero`` with
        ``symbolic_zeros=True``, else zero arrays, ``float0`` for integer
        arguments); ``primal_out`` has ``f``'s output structure, shapes and
        dtypes, and ``tangent_out`` the same structure with tangent dtypes
        (a ``SymbolicZero`` leaf allowed). Forward mode (``jax.jvp``,
        ``jax.jacfwd``, ``jax.linearize``) runs it instead of transposing
        ``bwd``, which is what makes forward mode work for an opaque
        ``bwd`` (a kernel, a callback); reverse mode never runs it. Under
        ``jax.linearize`` and ``jax.jacfwd`` only its tangent part runs (it
        is traced, and its primal part removed). ``jax.custom_jvp`` and
        ``jax.custom_vjp`` exclude each other on one function: this goes
        beyond both (``design/limitations.md``).

      fused: with all three rules, which pair the rematerialized backward
        region runs where it reads ``f``'s output: ``True``, ``f`` then
        ``fwd_bwd``; ``False``, ``fwd`` then ``bwd``; ``None`` (default),
        the cheaper by the traced rules' cost estimates (collectives, then
        operations, then opaque kernels; ties to the pair writing fewer
        bytes). Where the output is not read ``fwd_bwd`` runs alone unless
        ``fused=False``. Printed jaxprs say which and why
        (``backward=fwd+bwd (output read; fused costs more)``).

    Returns:
      None.

    Raises:
      TypeError: unless ``fwd`` and ``bwd``, or ``fwd_bwd``, or all three are
        given; when a given rule is not callable; when ``symbolic_zeros`` or
        ``generic_batching`` is not a bool (e.g. ``fwd_bwd`` passed by
        position); when ``fused`` is not ``None`` or a bool.
      NotImplementedError: ``generic_batching`` given where the installed
        ``jax.custom_vjp.defvjp`` has no such parameter (before jax 0.12).
    """
    del optimize_remat  # always on
    _jax_api.check_generic_batching(self.fun, "defvjp", generic_batching)
    if not isinstance(symbolic_zeros, (bool, int)) or callable(symbolic_zeros):
      raise TypeError(
          f"smart_custom_vjp function {function_name(self.fun)}: defvjp's third "
          f"argument is symbolic_zeros (a bool), got {type(symbolic_zeros).__name__}"
          "; the fused rule is keyword-only: defvjp(fwd, bwd, fwd_bwd=...).")
    has_pair = fwd is not None and bwd is not None
    if (fwd is None) != (bwd is None) or not (has_pair or fwd_bwd is not None):
      given = [n for n, r in (("fwd", fwd), ("bwd", bwd), ("fwd_bwd", fwd_bwd))
               if r is not None]
      raise TypeError(
          f"smart_custom_vjp function {function_name(self.fun)}: defvjp needs fwd "
          "and bwd, or fwd_bwd, or all three; got "
          f"{', '.join(given) if given else 'none of them'}.")
    for n, r in (("fwd", fwd), ("bwd", bwd), ("fwd_bwd", fwd_bwd),
                 ("jvp", jvp)):
      if r is not None and not callable(r):
        raise TypeError(
            f"smart_custom_vjp function {function_name(self.fun)}: defvjp's {n} "
            f"must be callable, got {type(r).__name__}.")
    if fused is not None and not isinstance(fused, bool):
      raise TypeError(
          f"smart_custom_vjp function {function_name(self.fun)}: defvjp's "
          f"fused must be None, True or False, got {type(fused).__name__}.")
    self.fwd, self.bwd, self.fwd_bwd = fwd, bwd, fwd_bwd
    self.symbolic_zeros = bool(symbolic_zeros)
    self.generic_batching = bool(generic_batching)
    self._jvp = jvp_rule = JvpRule(jvp) if jvp is not None else None
    remat = self.__dict__.get("_remat")
    self._rules = Rules(fun=self.fun, fwd=fwd, bwd=bwd, fwd_bwd=fwd_bwd,
                        symbolic_zeros=self.symbolic_zeros,
                        nondiff_argnums=self.nondiff_argnums,
                        remat=remat and dataclasses.replace(
                            remat, generic_batching=self.generic_batching,
                            jvp=jvp_rule),
                        generic_batching=self.generic_batching, jvp=jvp_rule,
                        fused=fused)
    self._cache = TraceLocalCache(_CACHE_SIZE)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    """Evaluates ``f(*args, **kwargs)``; its derivatives come from the rules.

    Args:
      *args: ``f``'s arguments: pytrees of arrays, or any Python value at a
        position marked by ``nondiff_argnums``/``nondiff_argnames``.
      **kwargs: ``f``'s arguments by name; they are bound to ``f``'s
        signature and passed on (to ``f`` and to the rules) by position.

    Returns:
      ``f``'s output, a pytree of arrays. With no transformation active
      ``f`` is simply called. Under a transformation the call is recorded as
      one smartvjp primitive (where ``jax.grad``/``jax.vjp`` apply directly,
      one that carries the traced ``fwd`` and no trace of ``f``), and the
      transformations pick the rule that runs.

    Raises:
      AttributeError: when ``defvjp`` (or another definition method) has not
        been called yet.
      TypeError: when the arguments do not fit ``f``'s signature (keyword-only
        parameters included); when a differentiable argument holds a value
        that is not a JAX type; when a rule returns the wrong structure
        (``fwd`` not an ``(out, residuals)`` pair, residuals that are not JAX
        types, ``bwd`` or ``fwd_bwd`` not a tuple with one cotangent per
        differentiable argument (but see ``ValueError``), or a cotangent of
        the wrong pytree structure); when ``fwd``'s primal output differs from ``f``'s in
        structure, shape or dtype where both are traced (a staged call
        differentiated, remat; as ``jax.custom_vjp``, which checks only
        there). Each message names the rule, the pytree path and expected vs
        actual.
      smartvjp.NotTransposableError: a ``TypeError`` raised by forward mode
        (``jax.jvp``, ``jax.jacfwd``, ``jax.linearize``) without a forward
        rule (``defvjp(..., jvp=...)``) when ``bwd`` (or ``fwd_bwd``) cannot
        be transposed in its cotangent (an opaque kernel, a callback), or
        when ``f`` or ``fwd`` cannot be traced (NumPy inside the rule, an
        eager library wrapper); the rule's own error is its ``__cause__``
        and, where that is not a ``TypeError``, it is also of that type.
      ValueError: when ``bwd`` (or ``fwd_bwd``) returns a cotangent whose
        shape differs from its argument's, as ``jax.custom_vjp``; with
        JAX's ``jax_custom_vjp3`` flag on, when it returns a tuple or list
        of the wrong length, as JAX does there; with JAX's
        mutable array checks on (the default), as ``jax.custom_vjp``, when
        one mutable array reference is passed through two differentiable
        arguments or when ``f`` or ``fwd`` returns a reference.
      jax.errors.UnexpectedTracerError: when a tracer is passed at a nondiff
        position; when a value that ``f`` closes over is differentiated
        together with its arguments, where ``jax.grad``, ``jax.vjp`` or
        ``jax.jvp`` apply directly to the call, through ``vmap``s too
        (``grad(vmap(F))``, ``jacfwd``): ``jax.custom_vjp`` raises this type
        there.
      CustomVJPException: when a value that ``f`` closes over is
        differentiated together with its arguments in a staged call
        (``jit(F)``, a ``scan`` or ``cond`` body, ``jax.checkpoint``): the
        type ``jax.custom_vjp`` raises there, a private class of JAX's
        (``CustomVJPException`` in its ``interpreters.ad`` module, not
        exported by ``jax.errors``).
    """
    rules = self._rules
    if rules is None:
      raise AttributeError(
          f"No VJP defined for smart_custom_vjp function {function_name(self.fun)} "
          "using defvjp.")
    args = _resolve_kwargs(self.fun, args, kwargs)
    for i in self.nondiff_argnums:
      _check_no_tracers(self.fun, args, i)
    nondiff = tuple(args[i] for i in self.nondiff_argnums)
    dyn = tuple(a for i, a in enumerate(args) if i not in self.nondiff_argnums)
    leaves, in_tree = tree_util.tree_flatten(dyn)
    avals = tuple(_aval(rules, dyn, i, x) for i, x in enumerate(leaves))
    # references, as jax.custom_vjp checks them: aliasing at every call (jax
    # 0.12; before, where f runs on the arguments themselves: _process.py)
    if _versions.ALIASED_REFS_CHECKED_AT_CALL:
      check_aliased_arguments(rules, "fun", len(args), in_tree, leaves)
    # the current trace processes the call (_process.py)
    call = Unprocessed(rules, nondiff, len(args), in_tree, avals, self._cache)
    outs = call_p.bind(*leaves, call=call)
    return tree_util.tree_unflatten(call.out_tree, outs)

  # -- jax.custom_vjp's newer definition methods (see _jax_api.py) -------------

  def defvjp_with_logs(self, fwd: Callable, bwd: Callable,
                       symbolic_zeros: bool = False,
                       optimize_remat: bool = False,
                       generic_batching: bool | None = None) -> None:
    """``jax.custom_vjp.defvjp_with_logs`` (jax 0.11.2): ``bwd`` returns
    ``(cotangents, logs)`` with ``logs`` ``None`` or a dict.

    As in JAX, for ``out, f_vjp = jax.vjp(fn, x)``, ``f_vjp.with_logs(ct)``
    returns ``(cotangents, logs)`` with the log entries of every such rule
    in the backward pass (through ``jit``, ``scan``, ``vmap``,
    ``checkpoint``), and a plain ``f_vjp(ct)`` drops them. A ``bwd`` that
    returns no pair, or logs that are neither ``None`` nor a dict, raises
    ``TypeError`` when it runs; a key logged twice in one backward pass
    raises ``ValueError``, as in JAX. The other arguments are ``defvjp``'s.

    Raises:
      NotImplementedError: when the installed ``jax.custom_vjp`` has no such
        method (before jax 0.11.2).
    """
    _jax_api.require_method(self.fun, "defvjp_with_logs", generic_batching)
    self.defvjp(fwd, _jax_api.without_logs(self.fun, bwd, "defvjp_with_logs"),
                symbolic_zeros, optimize_remat, generic_batching)
    self.fwd, self.bwd = fwd, bwd

  def defvjp_with_accums(self, fwd: Callable, bwd: Callable,
                         symbolic_zeros: bool = False,
                         optimize_remat: bool = False,
                         generic_batching: bool | None = None) -> None:
    """``jax.custom_vjp.defvjp_with_accums`` (jax 0.12): ``bwd(res, g,
    *accums)`` pushes cotangents into one accumulator per differentiable
    argument (pytrees of them, like the arguments) and returns ``None`` or
    logs. smartvjp hands it value accumulators (``accum(x)``), as JAX does
    where a transformation wraps the rule; the cotangents are the same as
    ``jax.custom_vjp``'s. Logs as in ``defvjp_with_logs``.

    Raises:
      NotImplementedError: when the installed ``jax.custom_vjp`` has no such
        method (before jax 0.12).
    """
    _jax_api.require_method(self.fun, "defvjp_with_accums", generic_batching)
    self.defvjp(_jax_api.with_arguments(fwd, self.nondiff_argnums),
                _jax_api.accums_bwd(self.fun, bwd, len(self.nondiff_argnums)),
                symbolic_zeros, optimize_remat, generic_batching)
    self.fwd, self.bwd = fwd, bwd

  def defremat(self, fwd: Callable, rem: Callable, bwd: Callable,
               generic_batching: bool | None = None) -> None:
    """``jax.custom_vjp.defremat`` (jax 0.12): rematerialization rules.

    ``fwd(*args) -> (out, res)`` runs in the forward pass and its residuals
    ``res`` are kept whatever the remat policy says; ``rem(res, *args) ->
    (out, res2)`` runs in the backward pass and ``bwd(res2, g)`` (nondiff
    arguments first) after it. Without ``defvjp``, these rules are also the
    VJP outside ``jax.checkpoint``. With ``defvjp`` rules too, those are used
    outside ``jax.checkpoint`` and where the policy keeps their residuals,
    and the ``defremat`` rules where it does not. JAX needs ``jax_remat3`` and
    ``jax_custom_vjp3`` for this method; smartvjp does not.

    Raises:
      NotImplementedError: when the installed ``jax.custom_vjp`` has no such
        method (before jax 0.12).
      TypeError: when a rule is not callable.
    """
    _jax_api.require_method(self.fun, "defremat", generic_batching)
    self._define_remat(fwd, rem, bwd, False, generic_batching)

  def defremat_with_logs(self, fwd: Callable, rem: Callable, bwd: Callable,
                         generic_batching: bool | None = None) -> None:
    """``jax.custom_vjp.defremat_with_logs`` (jax 0.12): ``defremat``
    whose ``bwd`` returns ``(cotangents, logs)`` (logs as in
    ``defvjp_with_logs``).

    Raises:
      NotImplementedError: when the installed ``jax.custom_vjp`` has no such
        method (before jax 0.12).
      TypeError: when a rule is not callable.
    """
    _jax_api.require_method(self.fun, "defremat_with_logs", generic_batching)
    self._define_remat(fwd, rem, bwd, True, generic_batching)

  def _define_remat(self, fwd, rem, bwd, with_logs, generic_batching):
    for n, r in (("fwd", fwd), ("rem", rem), ("bwd", bwd)):
      if not callable(r):
        raise TypeError(
            f"smart_custom_vjp function {function_name(self.fun)}: defremat's {n} "
            f"must be callable, got {type(r).__name__}.")
    remat = Rules(
        fun=self.fun, fwd=_jax_api.with_arguments(fwd, self.nondiff_argnums),
        bwd=_jax_api.remat_bwd(self.fun, rem, bwd, self.nondiff_argnums,
                               with_logs),
        fwd_bwd=None, symbolic_zeros=False,
        nondiff_argnums=self.nondiff_argnums, always_save=True,
        generic_batching=bool(generic_batching), jvp=self._jvp)
    self.generic_batching = bool(generic_batching)   # the last one, as JAX
    self._remat = remat
    if self._rules is not None and self._rules.fwd is not None:
      self._rules = dataclasses.replace(
          self._rules, remat=remat, generic_batching=remat.generic_batching)
    else:
      self._rules = remat
    self._cache = TraceLocalCache(_CACHE_SIZE)


def _aval(rules, dyn, i, x):
  try:
    return jx.core.typeof(x)
  except TypeError:
    path = tree_util.keystr(tree_util.tree_flatten_with_path(dyn)[0][i][0])
    raise rule_error(
        TypeError, rules, "fun",
        f"was called with a value of type {type(x).__name__} at "
        f"(differentiable) arguments{path}, which is not a valid JAX type; "
        "mark non-array arguments with nondiff_argnums.") from None


def _resolve_kwargs(fun, args, kwargs):
  try:
    return jx.api_util.resolve_kwargs(fun, args, kwargs)
  except TypeError as e:
    raise TypeError(
        f"The input arguments to the smart_custom_vjp function {function_name(fun)} "
        f"could not be resolved to positional arguments: {e}") from e


def _check_no_tracers(fun, args, i):
  for leaf in tree_util.tree_leaves(args[i]):
    if isinstance(leaf, jx.core.Tracer):
      raise UnexpectedTracerError(
          f"Found a JAX Tracer passed to smart_custom_vjp function "
          f"{function_name(fun)} as argument {i}, a position marked non-"
          "differentiable by nondiff_argnums/nondiff_argnames. Tracers "
          "cannot be non-differentiable arguments (as with jax.custom_vjp); "
          "use nondiff_argnums only for values that are not arrays, e.g. "
          "functions, and pass arrays as ordinary arguments.")
