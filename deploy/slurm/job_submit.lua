--[[
stager's job_submit/lua: copy a batch script's `#STAGER` lines into the job's
AdminComment, so that the planner (`stager plan`) reads every pending job's
declaration in its one `squeue` call per interval (squeue -O admin_comment) and
never reads a job script or asks Slurm once per job. Users cannot change a job's
AdminComment (only operators and SlurmUser can), so what the planner reads is
what the script said at submit.

The value is "stager1:" followed by the lines without their "#STAGER" word,
joined by ";", each with "%", ";", "|" and control characters written as %XX:
one line of squeue output whatever the script holds. docs/prestaging.md.

It never fails a submission: any error is logged and the job goes on as
submitted (the job then stages at its start, as without pre-staging). Install:
copy this file beside slurm.conf as job_submit.lua and set
JobSubmitPlugins=lua (append ",lua" to a list you already have).
--]]

local MARK = "stager1:"
-- Bounds what one job can make slurmctld keep and the planner parse.
local MAX_LINES = 32
local MAX_BYTES = 4096

-- "%", ";", "|", control bytes and every byte past ASCII, as %XX: the value is one
-- ASCII line of squeue's output whatever the script holds.
local function escape(text)
	return (text:gsub("[%%;|%c\128-\255]", function(c)
		return string.format("%%%02X", c:byte())
	end))
end

local SPACE, TAB = 32, 9

-- The line without its trailing spaces and tabs. A loop, not a pattern: "(.-)%s*$"
-- backtracks once per space of a run, quadratic in a line the user writes, and this
-- runs inside slurmctld.
local function trim_end(line)
	local last = #line
	while last > 0 do
		local byte = line:byte(last)
		if byte ~= SPACE and byte ~= TAB then
			break
		end
		last = last - 1
	end
	return line:sub(1, last)
end

-- The words of a "#STAGER" line (nil for any other line). Blanks are ASCII spaces and
-- tabs only, as stager-client reads the line (client/declare.py).
local function stager_words(line)
	if line:sub(1, 7) ~= "#STAGER" then
		return nil
	end
	local gap = line:byte(8)
	if gap ~= SPACE and gap ~= TAB then
		return nil
	end
	local first = 9
	while line:byte(first) == SPACE or line:byte(first) == TAB do
		first = first + 1
	end
	return trim_end(line:sub(first))
end

-- The declaration lines of a script, escaped; nil when it has none. Linear in the
-- script: every pattern below matches in one pass.
local function declarations(script)
	local found, size = {}, 0
	for line in script:gmatch("[^\n]*") do
		-- Only the comment block at the top counts, as for #SBATCH: stop at the first
		-- line that is neither blank nor a comment (stager-client's parser does the same).
		if line:sub(1, 1) ~= "#" and not line:find("^[ \t]*$") then
			break
		end
		-- Past the bound a line cannot be kept anyway: not even looked at.
		local words = #line <= MAX_BYTES and stager_words(line)
		if words and words ~= "" then
			local item = escape(words)
			size = size + #item + 1
			if #found >= MAX_LINES or size > MAX_BYTES then
				slurm.log_info("stager: job script has more than %d #STAGER lines or %d bytes of them; the rest are not pre-staged", MAX_LINES, MAX_BYTES)
				break
			end
			found[#found + 1] = item
		elseif #line > MAX_BYTES then
			slurm.log_info("stager: a comment line of over %d bytes in a job script is not read for #STAGER", MAX_BYTES)
		end
	end
	if #found == 0 then
		return nil
	end
	return MARK .. table.concat(found, ";")
end

local function apply(job_desc)
	local current = job_desc.admin_comment
	-- A value that looks like ours and did not come from this script is dropped.
	if current ~= nil and current:sub(1, #MARK) == MARK then
		job_desc.admin_comment = nil
		current = nil
	end
	local script = job_desc.script
	if script == nil then
		return -- srun/salloc: no script, nothing declared
	end
	local value = declarations(script)
	if value == nil then
		return
	end
	if current ~= nil and current ~= "" then
		slurm.log_info("stager: job has an AdminComment already; its #STAGER lines are not pre-staged")
		return
	end
	job_desc.admin_comment = value
end

function slurm_job_submit(job_desc, part_list, submit_uid)
	local ok, err = pcall(apply, job_desc)
	if not ok then
		slurm.log_error("stager: job_submit.lua: %s (the job goes on without pre-staging)", tostring(err))
	end
	return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
	return slurm.SUCCESS
end

slurm.log_info("stager: job_submit.lua loaded")
return slurm.SUCCESS
