"""The YAML editing application behind ``lookupdec reformat``: a config file reformatted or edited by a local model,
and written only when the result validated.

A run reads and checks each file, splits it into sections, asks the model for each section, validates every
answer, and writes only a result that validated. Each step is a small module, tested without a model:

- ``yamldata``: YAML as a run loads and compares it (unknown tags kept as opaque values, changes with paths);
- ``sections``: cutting a file into sections the model can edit, and joining them back;
- ``focus``: which entries of a file an instruction names, and whether a change is one it asked for;
- ``prompts``: what the model is asked for a section, and how its answer is read;
- ``validate``: what a run accepts (input, answers, results) and the errors that end it, with their exit codes;
- ``engine``: the model behind a run (tests replace it with a stub where the model does not matter);
- ``editor``: section sizes and budgets, batches, validation and retries (an edit's at the entries it names);
- ``run``: one run over the files, from reading to writing (:func:`~lookupdec.reformat.run.reformat_files`).
"""
