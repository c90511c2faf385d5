"""What only training does: the loop (`loop`: build the run, resume, step, record, save), the step
(`step`: what `genomelm plan` traces too), the memory stack around every layer (`memory`), the feed of
windows (`feed`), expert balancing (`balance`), the checks before the first step (`guards`), the held-out loss
during training (`heldout`) and the test hook for faults (`faults`). The command is `genomelm.commands.train`.
"""
