"""Who joins the batch each tick, and how much prompt it may prefill."""
