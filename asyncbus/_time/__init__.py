"""Time: envelopes published for later (``delay=``, ``at=``) and periodic schedules.

:mod:`.due` says when a publish is due and what clock every timer here reads;
:mod:`.held` keeps scheduled envelopes in this process (in memory), :mod:`.broker` in
the broker; :mod:`.ticks` and :mod:`.periodic` run periodic schedules, each tick once
per deployment; :mod:`.service` is what the bus calls.
"""
