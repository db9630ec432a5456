"""What a traced Keras step contains: the XLA-compiled function calls and their devices."""

from __future__ import annotations


def _traced_functions(keras_function):
    """The tf.functions behind `model.train_function` (etc.), Keras' closure over them."""
    found = []
    for cell in keras_function.__closure__ or ():
        value = cell.cell_contents
        if hasattr(value, "_list_all_concrete_functions"):
            found.append(value)
    return found


def compiled_calls(keras_function) -> list[str]:
    """Device of each call to an XLA-compiled function (`_XlaMustCompile`) in the step's traced graphs.

    Searches the top graph and every function in its library (nested tf.functions, loop bodies).
    """
    devices = []
    for function in _traced_functions(keras_function):
        for concrete in function._list_all_concrete_functions():
            graph_def = concrete.graph.as_graph_def()
            nodes = list(graph_def.node)
            for f in graph_def.library.function:
                nodes.extend(f.node_def)
            for node in nodes:
                attr = node.attr.get("_XlaMustCompile")
                if attr is not None and attr.b and node.op in ("StatefulPartitionedCall", "PartitionedCall"):
                    devices.append(node.device)
    return devices
