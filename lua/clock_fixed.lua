-- A fixed clock for conformance tests: the instant comes as the last ARGV.
-- Production scripts are built with clock.lua instead and take no time input.

-- A test's clock may run slower than the real one (a check per fake µs,
-- several real µs apart): relative expiries get an hour more, so that real
-- expiry never removes state the fake clock still needs. State past its
-- fake expiry reads as fresh anyway.
local EXPIRY_PAD_MS = 3600000

local function now_us()
  return tonumber(ARGV[#ARGV])
end
