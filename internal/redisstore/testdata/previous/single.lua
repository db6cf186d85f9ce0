-- The end of every previous check script: the algorithm's function is
-- take (previousScript defines it).
-- One check of one rule: KEYS[1] the bucket; ARGV capacity, rate or window
-- (µs), cost. Writes only when the request passes.
local allowed, remaining, retry, reset, commit =
  take(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), now_us())
if commit then commit() end
return {allowed, string.format('%.17g', remaining), retry, reset}
