"""The model-parallel runtime: DTensor variables by rule, batch-sharded inputs, one SPMD program per step."""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import one_device_strategy
from tensorflow.python.util import nest

from tfdist import errors
from tfdist._compat import dtensor as compat_dtensor
from tfdist._compat import keras_distribution as keras_distribution_hooks
from tfdist._compat import step_deadline
from tfdist._compat import variables as keras_variables
from tfdist.placement import attributes as attributes_lib
from tfdist.placement import mesh as mesh_lib
from tfdist.placement import report as report_lib
from tfdist.placement import roles as roles_lib
from tfdist.placement import rules as rules_lib
from tfdist.strategies import _extended
from tfdist.strategies import multi_worker
from tfdist.strategies.model_parallel.variables import GatheredVariable
from tfdist.strategies.model_parallel.variables import ShardedVariable
from tfdist.strategies.model_parallel.variables import gather
from tfdist.strategies.model_parallel.variables import layout_of
from tfdist.strategies.model_parallel.variables import replicated
from tfdist.strategies.model_parallel.variables import shard_value
from tfdist.strategies.model_parallel.variables import whole_sparse_operands

DataShardingWarning = errors.DataShardingWarning
# Keras names the gradient accumulators of `gradient_accumulation_steps` "<variable path>_gradient_accumulator".
ACCUMULATOR_SUFFIX = "_gradient_accumulator"


class DTensorBatches(tf.distribute.DistributedDataset):
    """Iterable over a dataset whose elements come out as batch-sharded DTensors.

    What `experimental_distribute_dataset` and `distribute_datasets_from_function`
    return: a `tf.distribute.DistributedDataset`, which Keras' `fit`, `evaluate`
    and `predict` take as it is (`tfdist._compat.trainer`). `iter()` starts the
    dataset's iterator at once (a reshuffling dataset draws its order then, as a
    tf.data iterator would), and each element is sharded as it is drawn.
    """

    def __init__(self, dataset, extended, *, local=False):
        self._dataset = dataset
        self._extended = extended
        self._local = local  # elements hold this process' rows of each global batch, not the whole batch

    def __iter__(self):
        shard = self._extended.shard_local_batch if self._local else self._extended.shard_batch
        return map(shard, iter(self._dataset))

    @property
    def element_spec(self):
        """The dataset's element spec (global batches: a DTensor's shape is its global shape)."""
        return self._dataset.element_spec

    @property
    def cardinality(self):
        """The number of batches, or `tf.data.UNKNOWN_CARDINALITY` / `INFINITE_CARDINALITY` (as a tf.data one's)."""
        if isinstance(self._dataset, tf.data.Dataset):
            return int(self._dataset.cardinality())
        return int(tf.data.UNKNOWN_CARDINALITY)


class ModelParallelExtended(_extended.TfdistExtended, one_device_strategy.OneDeviceExtended):
    """Creates DTensor variables by rule and runs Keras steps as one SPMD program.

    Args:
        container_strategy: the ModelParallelStrategy.
        mesh: the DTensor mesh every variable and batch is laid out on.
        rules: the `LayoutRules` that give each variable path its layout.
        batch_axis: the mesh axis batches are split over, or None.
        cluster: the processes that share the mesh, or None for this one.
        sharding: across processes, how a tf.data dataset is split.
        auto_shard: an `auto_shard.AutoShard` that also splits variables over
            the batch axis (sharded data parallelism), or None.
    """

    _tfdist_spmd = True

    def __init__(
        self, container_strategy, *, mesh, rules, batch_axis, cluster=None, sharding="auto", auto_shard=None
    ):
        super().__init__(container_strategy, mesh.local_devices()[0])
        self.mesh = mesh
        self.rules = rules
        self.auto_shard = auto_shard  # an AutoShard: sharded data parallelism over the batch axis, or None
        self.batch_axis = batch_axis
        self._axes = mesh_lib.mesh_axes(mesh)
        self._cluster = cluster
        self._sharding = sharding
        # This process' rows of each global batch: batch-axis indices [lo, lo + per) of its local devices.
        parts = self._axes[batch_axis] if batch_axis else 1
        if batch_axis and cluster is not None:
            indices = sorted({location[batch_axis] for location in mesh.local_device_locations()})
            self._batch_rows = (indices[0], len(indices), parts)
        else:
            self._batch_rows = (0, parts, parts)
        self._calls = threading.local()  # .depth: model calls in progress on this thread
        self._rules_checked = weakref.WeakSet()  # models whose unmatched rules were reported
        # Role rules (tfdist.layouts.auto()): a layer's build creates its variables once the block is built.
        self._roles = roles_lib.RoleFinder() if roles_lib.uses_roles(rules) else None
        compat_dtensor.register_mesh(mesh, self)

    # ------------------------------------------------------------------ variables
    @property
    def _tfdist_defer_variables(self) -> bool:
        return self._roles is not None

    def _tfdist_place_deferred(self, root, create) -> None:
        self._roles.find(root)
        with self._own_scope():
            create()

    def plan(self, path, shape, *, trainable=True, role=None, attribute_path=None):
        """Where a model variable goes: `(stored spec, compute spec or None, slot spec or None, note, chosen by)`.

        The stored spec is the rules' spec (a path rule's on the Keras `path`,
        else on its `attribute_path` in a subclassed model, else the role's,
        `roles_lib.Role`), plus the data axis on one dimension under sharded
        data parallelism with shard="weights"; the compute spec (None: as
        stored) is the layout reads take in a step; the slot spec (None: as
        stored) is where its optimizer slots go (shard="optimizer"). "Chosen
        by" names the rule (and the attribute path it matched) or role that
        decided the spec ("" for none).
        """
        spec, rule = self.rules.resolve(path, shape, self._axes, attribute_path=attribute_path)
        notes, chosen_by = [], report_lib.chosen_by_rule(rule, path, attribute_path)
        if rule is None and role is not None:
            spec, rule, note = roles_lib.resolve(self.rules, role, shape, self._axes)
            notes, chosen_by = [note] if note else [], role.description if rule is not None else ""
        compute = (None,) * len(shape) if rule is not None and rule.gather else None
        if compute is None and self.batch_axis is not None and self.batch_axis in spec:
            # Split over the batch axis too (FSDP-style, as KerasHub's layout maps split weights over the data
            # axis): stored so, gathered over that axis for each use. DTensor computes no matmul whose operands
            # split the contracting dimension over different axes (the batch's and the weight's).
            compute = tuple(None if a == self.batch_axis else a for a in spec)
        auto, slot = self.auto_shard, None
        if auto is None:
            return spec, compute, None, "; ".join(notes), chosen_by
        self._check_auto_rule(path, rule)
        if not trainable and len(shape):
            notes.append(f"replicated over {auto.axis!r}: not trainable (as FSDP leaves buffers)")
            return spec, compute, None, "; ".join(notes), chosen_by
        split, note = auto.extend(spec, shape)
        if split != spec and auto.mode == "weights":
            compute, spec = compute or spec, split
        elif split != spec:
            slot, note = split, f"weight whole over {auto.axis!r}; optimizer slots {note}"
        return spec, compute, slot, "; ".join([*notes, note]), chosen_by

    def _create_variable(self, next_creator, **kwargs):
        colocate_with = kwargs.pop("colocate_with", None)
        for unused in ("distribute_strategy", "layout", "use_resource", "shape"):
            kwargs.pop(unused, None)
        init = kwargs.pop("initial_value")
        with tf.init_scope():
            if callable(init):
                init = init()
            init = tf.convert_to_tensor(init, dtype=kwargs.get("dtype"))
            if dtensor.is_dtensor(init):
                init = gather(init)
            shape = tuple(init.shape)
            note, compute, slot, role, chosen_by = "", None, None, None, ""
            if isinstance(colocate_with, dtensor.DVariable) and tuple(colocate_with.shape) == shape:
                # An optimizer slot follows its variable (ZeRO-1: split as planned for the variable's slots). A
                # gradient accumulator stays in its variable's layout: Keras adds it to the (whole) gradient.
                layout = colocate_with.layout
                note = getattr(colocate_with, "_tfdist_note", "")
                chosen_by = getattr(colocate_with, "_tfdist_chosen_by", "")
                if not str(kwargs.get("name") or "").endswith(ACCUMULATOR_SUFFIX):
                    layout = getattr(colocate_with, "_tfdist_slot_layout", None) or layout
                elif getattr(colocate_with, "_tfdist_slot_layout", None) is not None:
                    note = f"replicated over {self.auto_shard.axis!r}: a gradient accumulator, laid out as its weight"
            elif colocate_with is not None:
                layout = replicated(self.mesh, len(shape))
            else:
                path = keras_variables.variable_path(kwargs.get("name") or "variable")
                if self._roles is not None:
                    role = self._roles.role_of(keras_variables.creating_variable())
                spec, compute, slot, note, chosen_by = self.plan(
                    path, shape, trainable=kwargs.get("trainable", True), role=role,
                    attribute_path=attributes_lib.path_at_creation(keras_variables.creating_variable(), self.rules),
                )
                layout = layout_of(spec, self.mesh)
            if compute is not None:
                compute = layout_of(compute, self.mesh)
                variable = GatheredVariable(shard_value(init, layout), compute_layout=compute, **kwargs)
            else:
                variable = ShardedVariable(shard_value(init, layout), **kwargs)
            variable._tfdist_note = note
            variable._tfdist_role = role
            variable._tfdist_chosen_by = chosen_by
            if slot is not None:
                variable._tfdist_slot_layout = layout_of(slot, self.mesh)
            variable._tfdist_relayout_assign = self.auto_shard is not None
            return variable

    def _check_auto_rule(self, path, rule) -> None:
        """Raises when a layout rule for `path` uses the axis that sharded data parallelism splits over."""
        axis = self.auto_shard.axis
        if rule is not None and axis in rule.axes:
            raise ValueError(
                f"Layout rule {rule} (matching {path!r}) splits a dimension over mesh axis {axis!r}, the axis "
                f"that sharded data parallelism (shard={self.auto_shard.mode!r}) splits variables over itself. "
                f"A rule may use only the other mesh axes ({[a for a in self._axes if a != axis]}); remove "
                f"{axis!r} from its spec and the data axis will split one of the dimensions it keeps whole."
            )

    def _validate_colocate_with_variable(self, colocate_with_variable):
        del colocate_with_variable  # any variable; its layout is reused when shapes agree

    # ------------------------------------------------------------------ inputs
    def shard_batch(self, structure):
        """Packs each tensor of `structure` into a DTensor split on the batch axis (scalars replicated)."""
        return nest.map_structure(self._shard, structure)

    def _shard(self, value):
        if value is None or (isinstance(value, tf.Tensor) and dtensor.is_dtensor(value)):
            return value
        value = tf.convert_to_tensor(value)
        rank = value.shape.rank
        if not rank or self.batch_axis is None:
            return shard_value(value, replicated(self.mesh, rank or 0))
        if value.shape[0] % self._axes[self.batch_axis]:
            # A batch the batch axis does not divide (the last one of a dataset): every device computes all of it.
            # The step is the one-device step (a trace of its own, as its shape is new anyway).
            return shard_value(value, replicated(self.mesh, rank))
        return shard_value(value, dtensor.Layout.batch_sharded(self.mesh, self.batch_axis, rank))

    _tfdist_shard_batch = shard_batch  # the *_on_batch hook shards host inputs with it

    def _tfdist_place_plain_inputs(self, tensors):
        """Plain eager tensors passed to a traced function of this mesh's variables, packed onto the mesh.

        Those whose leading dimension is the batch size (the one most of them
        share) are split on the batch axis (when it divides it); the others
        are replicated.
        """
        sizes = [t.shape[0] for t in tensors if t.shape.rank]
        batch = max(sizes, key=sizes.count) if sizes else None

        def place(t):
            if t.shape.rank and t.shape[0] == batch:
                return self._shard(t)
            return shard_value(t, replicated(self.mesh, t.shape.rank))

        return [place(t) for t in tensors]

    def _tfdist_plain_outputs(self, outputs, *, recorded):
        """The outputs of such a call: plain tensors, or replicated DTensors when a gradient tape may record it."""
        outputs = self._readable(outputs)
        if recorded:
            return outputs
        return nest.map_structure(
            lambda v: dtensor.unpack(v)[0] if isinstance(v, tf.Tensor) and dtensor.is_dtensor(v) else v, outputs
        )

    @property
    def batch_groups(self) -> tuple[int, int]:
        """`(number, index)`: how many processes' row ranges make a global batch, and this process' range.

        Processes whose devices share the batch-axis indices (a model split
        across processes) form one group and read the same examples.
        """
        lo, per, parts = self._batch_rows
        return parts // per, lo // per

    def shard_local_batch(self, structure):
        """Packs this process' rows of a global batch (its batch group's part) into global DTensors."""
        return nest.map_structure(self._shard_local, structure)

    def _shard_local(self, value):
        if value is None or (isinstance(value, tf.Tensor) and dtensor.is_dtensor(value)):
            return value
        value = tf.convert_to_tensor(value)
        rank = value.shape.rank
        if not rank or self.batch_axis is None:
            return shard_value(value, replicated(self.mesh, rank or 0))
        lo, per, _ = self._batch_rows
        if value.shape[0] % per:
            raise ValueError(
                f"Worker {self._cluster.rank}'s part of a global batch has {value.shape[0]} examples, which "
                f"cannot be split over its {per} indices of mesh axis {self.batch_axis!r}. Give every process "
                f"batches of a size divisible by {per} (and the same size on every process)."
            )
        step = value.shape[0] // per
        components = []
        for location in self.mesh.local_device_locations():
            start = (location[self.batch_axis] - lo) * step
            components.append(value[start : start + step])
        return dtensor.pack(components, dtensor.Layout.batch_sharded(self.mesh, self.batch_axis, rank))

    def _experimental_distribute_dataset(self, dataset, options):
        del options
        groups, _ = self.batch_groups
        if groups == 1 or not isinstance(dataset, tf.data.Dataset):
            return DTensorBatches(dataset, self)
        sharding = self._sharding
        policy = dataset.options().experimental_distribute.auto_shard_policy
        chosen = {
            tf.data.experimental.AutoShardPolicy.DATA: "data",
            tf.data.experimental.AutoShardPolicy.FILE: "file",
            tf.data.experimental.AutoShardPolicy.OFF: "off",
        }.get(policy)
        if chosen is not None:
            sharding = chosen  # a policy set on the dataset wins, as under MultiWorkerStrategy
        if sharding == "auto":
            sharding = "data"
            files = multi_worker.reads_files(dataset)
            warnings.warn(
                f"tfdist.ModelParallelStrategy: each of the {groups} groups of processes that hold different rows "
                f"of a batch reads all of the dataset and keeps its rows of every global batch (DATA sharding; "
                f"exact, but {groups}x the input work)"
                + (": a dataset is not split by file across processes, which could not ensure that the processes "
                   "agree on the size of every global batch" if files else "")
                + ". Pass sharding='data' to silence this warning, or sharding='off' and give each process its "
                "own rows.",
                DataShardingWarning,
                stacklevel=3,
            )
        if sharding == "file":
            raise ValueError(
                "tfdist.ModelParallelStrategy across processes does not split a dataset by file: the processes "
                "must agree on the size of every global batch, which files of different lengths do not ensure. "
                "Use sharding='data' (each process reads all and keeps its rows; exact) or sharding='off' (each "
                f"process's dataset yields only its rows: group {self.batch_groups[1]} of {groups}, see "
                "`strategy.extended.batch_groups`)."
            )
        return DTensorBatches(dataset, self, local=sharding == "off")

    def _distribute_datasets_from_function(self, dataset_fn, options):
        del options
        return DTensorBatches(dataset_fn(tf.distribute.InputContext()), self)

    def _tfdist_all_gather_rows(self, row):
        """Every process' `row` (shape [1, n]), as [processes, n]: one all-gather over the whole mesh."""
        sizes = list(self._axes.values())
        row = tf.constant(row, tf.float64)
        local = tf.reshape(row, [1] * len(sizes) + [row.shape[1]])
        layout = dtensor.Layout(list(self._axes) + [dtensor.UNSHARDED], self.mesh)
        packed = dtensor.pack([local] * self.mesh.num_local_devices(), layout)
        with step_deadline.timed("all-gather rows"):
            whole = dtensor.unpack(dtensor.relayout(packed, replicated(self.mesh, len(sizes) + 1)))[0]
        rows = tf.reshape(whole, [-1, row.shape[1]]).numpy()  # one row per device, by global device id
        return rows[:: self.mesh.num_local_devices()]

    # ------------------------------------------------------------------ execution
    # Grappler's memory optimizer changes nothing in the SPMD-expanded per-device graphs, costs 0.5 s per device
    # at the first step and logs error-level cost-estimate noise: Keras' steps run without it.
    _tfdist_step_call_context = staticmethod(compat_dtensor.no_memory_optimizer)

    def _tfdist_jit_compile(self, model) -> None:
        # DTensor expands a step into per-device functions and runs them without XLA on CPUs and GPUs:
        # Keras' jit_compile=True would be accepted and silently do nothing.
        raise ValueError(
            f"ModelParallelStrategy does not compile steps with XLA: model {model.name!r} was compiled with "
            "jit_compile=True, and TensorFlow's DTensor runs the SPMD-expanded step's per-device functions "
            'without XLA (the flag would be ignored). Compile the model with jit_compile=False (or "auto", '
            "which is False here), or train with DataParallelStrategy or PipelineStrategy, which compile each "
            "replica's step (each stage's layers) with XLA."
        )

    def _call_for_each_replica(self, fn, args, kwargs):
        if tf.executing_eagerly():  # inside a traced step, inputs are DTensors already
            args = self.shard_batch(args)
            kwargs = self.shard_batch(kwargs or {})
        with one_device_strategy._OneDeviceReplicaContext(self._container_strategy()):
            outputs = fn(*args, **(kwargs or {}))
        return self._readable(outputs)  # Keras reads step outputs on the host

    def _readable(self, structure):
        """`structure` with each tensor of rank >= 1 replicated, so that the host can read it."""

        def one(value):
            if isinstance(value, tf.Tensor) and value.shape.rank:
                return dtensor.relayout(value, replicated(self.mesh, value.shape.rank))
            return value

        return nest.map_structure(one, structure)

    # ------------------------------------------------------------------ custom loops without `run`
    def _own_scope(self):
        """This strategy's scope, unless it is already the current strategy."""
        strategy = self._container_strategy()
        return contextlib.nullcontext() if tf.distribute.get_strategy() is strategy else strategy.scope()

    def _tfdist_apply_outside_replica(self, grads, apply):
        # Keras' apply as in `run`: its slots are created in the scope, its merge_call finds a replica context.
        with self._own_scope(), one_device_strategy._OneDeviceReplicaContext(self._container_strategy()):
            return apply(grads)

    def _tfdist_call_model(self, model, call, args, kwargs):
        # A model called in the strategy's scope or outside it: the variables it creates are DTensor variables.
        # Eager host arrays and tensors among its arguments are split on the batch axis (Python values stay),
        # and then its outputs come back replicated, readable on the host.
        leaves = nest.flatten((args, kwargs))
        host = tf.executing_eagerly() and any(
            isinstance(v, np.ndarray) or (isinstance(v, tf.Tensor) and not dtensor.is_dtensor(v)) for v in leaves
        )
        if host:
            args, kwargs = nest.map_structure(
                lambda v: self._shard(v) if isinstance(v, (np.ndarray, tf.Tensor)) else v, (args, kwargs)
            )
        depth = getattr(self._calls, "depth", 0)
        self._calls.depth = depth + 1
        try:
            with self._own_scope():
                outputs = call(*args, **kwargs)
        finally:
            self._calls.depth = depth
        # The rules are checked on the outermost model once it is built, not on a model called inside another
        # one nor on one called on Keras inputs (it is being composed into a bigger model).
        if depth == 0 and model.built and not any(isinstance(v, keras.KerasTensor) for v in leaves):
            self._warn_unmatched_rules_once(model)
        return self._readable(outputs) if host else outputs

    def _tfdist_distribute_tensor(self, tensor, layout):
        # A Keras LayoutMap's "<layer>/output" key, met while a model created under this strategy runs (its
        # tensors are DTensors): a DTensor relayout to that layout, on this mesh. A dimension whose size is
        # unknown when traced, or that its mesh axis does not divide (a batch the batch axis does not divide
        # is computed whole on every device), keeps the layout DTensor gave it (MATCH). Elsewhere (Keras'
        # symbolic build, a model of no strategy) the tensor is returned as it is.
        if not getattr(self._calls, "depth", 0):
            return tensor
        return nest.map_structure(lambda value: self._relayout_activation(value, layout), tensor)

    def _relayout_activation(self, value, layout):
        if not isinstance(value, tf.Tensor) or (tf.executing_eagerly() and not dtensor.is_dtensor(value)):
            return value
        key = keras_distribution_hooks.layer_output_path()
        axes = tuple(layout.axes)
        keras_mesh = getattr(layout, "device_mesh", None)
        if keras_mesh is not None and rules_lib.device_mesh_axes(keras_mesh) != self._axes:
            raise ValueError(
                f"The activation layout of {key!r} (LayoutMap key) is on the mesh "
                f"{rules_lib.device_mesh_axes(keras_mesh)!r}, but the model runs under a ModelParallelStrategy "
                f"on the mesh {self._axes!r}. Give the LayoutMap the strategy's DeviceMesh."
            )
        if value.shape.rank != len(axes):
            raise ValueError(
                f"The activation layout of {key!r} (LayoutMap key) has {len(axes)} entries {axes!r}, but the "
                f"layer's output has shape {tuple(value.shape)} (rank {value.shape.rank}). Give one entry per "
                "dimension (None keeps a dimension whole)."
            )
        specs = []
        for axis, size in zip(axes, value.shape):
            if axis is None:
                specs.append(dtensor.UNSHARDED)
            elif axis not in self._axes:
                raise ValueError(
                    f"The activation layout of {key!r} (LayoutMap key) names mesh axis {axis!r}, which the mesh "
                    f"{self._axes!r} does not have. Valid axes: {list(self._axes)} or None."
                )
            elif size is None or size % self._axes[axis]:
                specs.append(dtensor.MATCH)
            else:
                specs.append(axis)
        return dtensor.relayout(value, dtensor.Layout(specs, self.mesh))

    def unmatched_rules(self, model):
        """`(rule, similar paths)` for each layout rule that matched no weight of `model` (Keras or attribute path).

        Role rules count as one: all of them are listed (with no similar paths)
        only when they found no role in the model at all.
        """
        attribute_paths = attributes_lib.attribute_paths(model).values()
        unmatched = self.rules.unmatched((w.path for w in model.weights), attribute_paths)
        if self._roles is not None:
            role_rules = [rule for rule in self.rules if isinstance(rule, roles_lib.RoleRule)]
            found = [getattr(getattr(w, "value", w), "_tfdist_role", None) for w in model.weights]
            if not {role.kind for role in found if role is not None} & {rule.role for rule in role_rules}:
                unmatched += [(rule, []) for rule in role_rules]
        return unmatched

    def _warn_unmatched_rules_once(self, model) -> None:
        if model in self._rules_checked:
            return
        self._rules_checked.add(model)
        unmatched = self.unmatched_rules(model)
        if unmatched:
            warnings.warn(
                f"ModelParallelStrategy: model {model.name!r} is built, and the weights these layout rules were "
                "meant for stay replicated: " + "; ".join(report_lib.unmatched_rule_lines(unmatched)) + ". "
                "Fix the patterns (`strategy.placement_report(model)` lists every weight's path).",
                UserWarning,
                stacklevel=3,
            )

    def _tfdist_sparse_operands(self, densify, x1, x2):
        # Inside a step, Keras' sparse arithmetic on an IndexedSlices gradient gets whole operands (see there).
        if tf.executing_eagerly():
            return x1, x2
        return whole_sparse_operands(densify, x1, x2, self.mesh)

    def _update(self, var, fn, args, kwargs, group):
        # ZeRO-1: the (replicated) gradient of a weight whose optimizer slots are split is sliced to their layout
        # first, so that each device computes its part of the update (the assign gathers the new weight). Without
        # the explicit boundary, DTensor's layout propagation pulls the slots' split back into the backward pass.
        backing = getattr(var, "_value", var)
        slot_layout = getattr(backing, "_tfdist_slot_layout", None)
        if slot_layout is not None and args and not tf.executing_eagerly():
            grad = args[0]
            if isinstance(grad, tf.Tensor):  # an IndexedSlices gradient stays as Keras' optimizers expect it
                # First in the weight's layout, as the backward pass computes it (a convolution's filter gradient
                # can only be whole over the batch axis), then in the slots'.
                grad = dtensor.relayout(dtensor.relayout(grad, backing.layout), slot_layout)
                args = (grad,) + tuple(args[1:])
        return self._update_non_slot(var, fn, (var,) + tuple(args), kwargs, group)

    def _update_non_slot(self, colocate_with, fn, args, kwargs, group):
        del colocate_with
        with distribute_lib.UpdateContext(self._device):
            result = fn(*args, **kwargs)
            return result if group else nest.map_structure(self._local_results, result)


