"""The actor's side: the loop that samples problems, asks the fleet, verifies and shapes rewards,
and appends finished groups to the durable stream (``loop``); one group's rewards and advantages
(``grouping``); its settings (``config``)."""
