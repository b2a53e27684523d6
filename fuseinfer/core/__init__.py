"""The bottom layer: errors, environment knobs, atomic files, data sets, configuration types, patch state,
weight placement, decode-plan types and the compiled extension's loader. Imports nothing else of fuseinfer."""
