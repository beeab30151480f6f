"""Built-in FP8 training recipes (`model.float8_recipe`): tensorwise and rowwise dynamic scaling."""
