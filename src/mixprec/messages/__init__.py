"""How mixprec's messages reach the user: where a warning points (:mod:`mixprec.messages.location`)."""
